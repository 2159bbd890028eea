"""`pdserve prefill MODEL --router HOST:PORT [flags]` (also `python -m pdserve.prefill_node`)."""

from __future__ import annotations

from pdserve.common.node.launch import run_node


def main(argv: list[str] | None = None) -> None:
    from pdserve.prefill_node.node import PrefillNode

    run_node(
        PrefillNode,
        "pdserve prefill",
        "A prefill node: chunked prefill, KV pages shipped to the decode node's blocks.",
        argv,
    )


if __name__ == "__main__":
    main()
