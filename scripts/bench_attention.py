"""`pdserve bench attention` as a script (the commands in docs/ cite it); flags: --help."""

from pdserve.bench.attention import main

if __name__ == "__main__":
    main()
