"""`Window`: one interval's measurements, gathered as requests arrive, finish their prefill and
finish decoding, and closed into `Figures` when the planner reads them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Figures:
    """An interval's arrivals (per second, mean lengths), the prefill rate measured through
    the P/D path (the last measured when the interval computed no prompt; None before the
    first), and the p90 TTFT and ITL of the requests that reached them (None: none did)."""

    arrival_rate: float
    mean_prompt: float
    mean_output: float
    prefill_rate: float | None
    ttft_p90: float | None
    itl_p90: float | None


class Window:
    def __init__(self) -> None:
        self._rate: float | None = None
        self._open()

    def _open(self) -> None:
        self._arrivals, self._prompt, self._output = 0, 0, 0
        self._prefilled, self._busy = 0, 0.0
        self._ttfts: list[float] = []
        self._itls: list[float] = []

    def arrived(self, prompt: int, output: int) -> None:
        self._arrivals += 1
        self._prompt += prompt
        self._output += output

    def prefilled(self, tokens: int, seconds: float, ttft: float) -> None:
        self._prefilled += tokens
        self._busy += seconds
        self._ttfts.append(ttft)

    def finished(self, itl: float | None) -> None:
        if itl is not None:
            self._itls.append(itl)

    def close(self, interval: float) -> Figures:
        if self._busy > 0:
            self._rate = self._prefilled / self._busy
        n = self._arrivals
        figures = Figures(
            n / interval,
            self._prompt / n if n else 0.0,
            self._output / n if n else 0.0,
            self._rate,
            p90(self._ttfts),
            p90(self._itls),
        )
        self._open()
        return figures


def p90(values: list[float]) -> float | None:
    return sorted(values)[int(0.9 * (len(values) - 1))] if values else None
