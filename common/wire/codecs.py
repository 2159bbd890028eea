"""Engine values <-> their wire form: sampling parameters and logprobs as msgpack-able data.

They live with the messages (not with the node) so that the router, which decodes them too,
never imports engine code.
"""

from __future__ import annotations

import dataclasses

from pdserve.common.engine.request import TokenLogprobs
from pdserve.common.engine.sampling_params import SamplingParams


def sampling_from_wire(d: dict) -> SamplingParams:
    """SamplingParams from a wire dict; ValueError on bad fields."""
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown sampling fields {sorted(unknown)}")
    return SamplingParams(**d)


def sampling_to_wire(p: SamplingParams) -> dict:
    d = dataclasses.asdict(p)
    d["stop_token_ids"] = list(p.stop_token_ids)
    so = d.get("structured_outputs")
    if so is not None:  # only the constraint that is set: the rest are defaults
        d["structured_outputs"] = {k: v for k, v in so.items() if v not in (None, False)}
    return d


def logprobs_to_wire(lps: tuple[TokenLogprobs, ...]) -> tuple:
    return tuple((lp.token_id, lp.logprob, tuple(lp.top)) for lp in lps)


def logprobs_from_wire(wire: tuple) -> tuple[TokenLogprobs, ...]:
    return tuple(TokenLogprobs(t, lp, tuple(tuple(x) for x in top)) for t, lp, top in wire)


def ranked_logprobs_to_wire(lps: tuple[TokenLogprobs, ...]) -> tuple:
    """Prompt logprobs: as logprobs_to_wire, with each token's rank."""
    return tuple((lp.token_id, lp.logprob, tuple(lp.top), lp.rank) for lp in lps)


def ranked_logprobs_from_wire(wire: tuple) -> tuple[TokenLogprobs, ...]:
    return tuple(
        TokenLogprobs(t, lp, tuple(tuple(x) for x in top), rank) for t, lp, top, rank in wire
    )
