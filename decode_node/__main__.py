"""python -m decode_node --model DIR --router HOST:PORT [--role both] [engine flags]"""

import sys

from common.launch import run_node
from common.node import ColocatedNode
from decode_node.node import DecodeNode

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--role" in argv:  # --role both: one engine that prefills and decodes (colocated)
        i = argv.index("--role")
        role = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i : i + 2]
        if role not in ("both", "decode"):
            sys.exit(f"--role must be 'decode' or 'both', got {role!r}")
        if role == "both":
            run_node(ColocatedNode, "pdserve colocated node", argv)
            sys.exit(0)
    run_node(DecodeNode, "pdserve decode node", argv, pass_args=("kv_connector", "host", "kv_port"))
