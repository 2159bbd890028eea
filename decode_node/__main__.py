"""`pdserve decode MODEL --router HOST:PORT [--role decode|both] [flags]`
(also `python -m pdserve.decode_node`)."""

from __future__ import annotations

import sys

from pdserve.common.node.launch import run_node


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    role = "decode"
    if "--role" in argv:  # --role both: one engine that prefills and decodes (colocated)
        i = argv.index("--role")
        role = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i : i + 2]
    if role == "both":
        from pdserve.common.node.colocated import ColocatedNode

        run_node(
            ColocatedNode,
            "pdserve decode --role both",
            "A colocated node: prefill and decode in one engine (mixed batches).",
            argv,
        )
    elif role == "decode":
        from pdserve.decode_node.node import DecodeNode

        run_node(
            DecodeNode,
            "pdserve decode",
            "A decode node: reserves blocks, receives KV, decodes with continuous batching.\n"
            "--role both makes it a colocated node (prefill and decode in one engine).",
            argv,
        )
    else:
        sys.exit(f"--role must be 'decode' or 'both', got {role!r}")


if __name__ == "__main__":
    main()
