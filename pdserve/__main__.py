"""`python -m pdserve ...` is the `pdserve` command (how `pdserve serve` starts its children)."""

from pdserve.cli import main

main()
