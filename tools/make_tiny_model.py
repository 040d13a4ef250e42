#!/usr/bin/env python3
"""Write a random-weight Hugging Face checkpoint (see ferroxmp/tiny_model.py).

    tools/make_tiny_model.py --shape qwen3 --out /tmp/qwen3-tiny [--seed N] [--dtype float32]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ferroxmp.tiny_model import SHAPES, build_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build a random-weight checkpoint with a trained BPE tokenizer.")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="override the shape's dtype (the same random draw, cast)")
    a = p.parse_args(argv)
    print(build_model(a.shape, a.out, a.seed, a.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
