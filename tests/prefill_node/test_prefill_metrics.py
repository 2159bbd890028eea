"""The prefill node's side of the KV transfer metrics: a send that fails is counted on the
prefill node's /metrics (`pdserve:kv_transfer_failures`), per connector, like the decode
node's; a send that goes through is not."""

from __future__ import annotations

from pdserve.common.wire.messages import Error, Failure, Tokens
from pdserve.kv_transfer.base import TransferError
from tests.prefill_node.test_prefill_node import nodes, start  # noqa: F401 (the fixture)

FAILURES = "pdserve:kv_transfer_failures_total"


def failures(prefill) -> float:
    labels = {"role": "prefill", "node_id": prefill.node_id, "connector": "zmq"}
    value = prefill.metrics.registry.get_sample_value(FAILURES, labels)
    assert value is not None, f"{FAILURES} is not on the prefill node's /metrics"
    return value


def test_a_failed_kv_send_is_counted_on_the_prefill_node(nodes) -> None:  # noqa: F811
    router, prefill, decode_ = nodes
    start(router, prefill, decode_, "good", list(range(5, 30)))
    while "good" in prefill.dests:
        prefill.step()
    assert router.recv(Tokens, "good").token_ids
    assert failures(prefill) == 0, "a transfer that went through is no failure"
    start(router, prefill, decode_, "bad", list(range(3, 60)))
    sender = next(iter(prefill.kv.port.senders.values()))

    def broken(*_):
        raise TransferError("peer went away")

    sender.send_layer = broken
    prefill.step()
    assert router.recv(Error, "bad").kind is Failure.KV_FAILED
    assert failures(prefill) == 1
