"""`pdserve bench kernels` as a script (the commands in docs/ cite it); flags: --help."""

import sys

from pdserve.bench.gpu import kernels_main

if __name__ == "__main__":
    sys.exit(kernels_main())
