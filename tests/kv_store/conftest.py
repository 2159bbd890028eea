from __future__ import annotations

from tests.kv_store.helpers import redis_server  # noqa: F401  (the tests' fixture)
