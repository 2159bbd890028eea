"""python -m decode_node --model DIR --router HOST:PORT [--role decode|both] [engine flags]"""

import sys

from common.launch import run_node


def main() -> None:
    argv = sys.argv[1:]
    role = "decode"
    if "--role" in argv:  # --role both: one engine that prefills and decodes (colocated)
        i = argv.index("--role")
        role = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i : i + 2]
    if role == "both":
        from common.node import ColocatedNode

        run_node(ColocatedNode, "pdserve colocated node", argv)
    elif role == "decode":
        from decode_node.node import DecodeNode

        run_node(DecodeNode, "pdserve decode node", argv, ("kv_connector", "host", "kv_port"))
    else:
        sys.exit(f"--role must be 'decode' or 'both', got {role!r}")


if __name__ == "__main__":
    main()
