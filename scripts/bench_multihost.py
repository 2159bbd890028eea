"""`pdserve bench multihost` as a script (docs/benchmarks.md cites it); needs root; --help."""

import sys

from pdserve.bench.multihost import main

if __name__ == "__main__":
    sys.exit(main())
