"""`pdserve bench chaos` as a script (the commands in docs/ cite it); flags: --help."""

import sys

from pdserve.bench.chaos import main

if __name__ == "__main__":
    sys.exit(main())
