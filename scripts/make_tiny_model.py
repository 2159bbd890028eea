"""Write a tiny random Llama-family checkpoint with a trained tokenizer (thin CLI).

python scripts/make_tiny_model.py --arch qwen3 --out /tmp/tiny-qwen3 --layers 2
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pdserve.tiny_model import TINY_ARCHS, make_tiny_model

# Flags whose values become config overrides under the same (short) names.
_SIZE_FLAGS = (
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "vocab",
    "intermediate",
    "max_position",
    "sliding_window",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The CLI flags; sizes left out keep make_tiny_model's small defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=TINY_ARCHS, required=True)
    parser.add_argument("--out", required=True, help="directory to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    for flag in _SIZE_FLAGS:
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Build the model described by argv and print where it went."""
    args = parse_args(argv)
    sizes = {f: getattr(args, f) for f in _SIZE_FLAGS if getattr(args, f) is not None}
    print(make_tiny_model(args.arch, args.out, seed=args.seed, **sizes))


if __name__ == "__main__":
    main()
