"""`pdserve bench tracing` as a script (the commands in docs/ cite it); flags: --help."""

import sys

from pdserve.bench.tracing import main

if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
