"""`pdserve serve` (placeholder: the supervisor lands next; runs the local cluster)."""

from __future__ import annotations

from pdserve.local_cluster import main  # noqa: F401
