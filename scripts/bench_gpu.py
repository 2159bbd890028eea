"""`pdserve bench gpu` as a script (docs/gpu.md cites it); flags: --help. Needs a CUDA GPU."""

import sys

from pdserve.bench.gpu import main

if __name__ == "__main__":
    sys.exit(main())
