"""`eyas convert-gguf`: turn a llama.cpp GGUF file into an HF checkpoint directory eyas can load.

Usage: eyas convert-gguf SmolLM2-135M-Instruct.Q4_1.gguf ./smollm2 --dtype bf16
"""

import argparse
from pathlib import Path

from eyas.models.gguf import DTYPES, convert_gguf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, metavar="SRC.gguf", help="GGUF file (Llama or Qwen2 architecture)")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="directory to create; must not exist or be empty")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="weight dtype after dequantizing")


def run(args: argparse.Namespace) -> int:
    print(convert_gguf(args.src, args.out_dir, dtype=args.dtype))
    return 0
