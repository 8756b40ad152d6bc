"""`eyas train`: the whole EAGLE-3 training pipeline from one recipe, or one stage of it.

Usage: eyas train --config recipes/smollm2-135m-eagle3.toml --device cuda --out out/smollm2
       eyas train regen --config recipes/smollm2-135m-eagle3.toml --num-samples 500
       eyas train capture --config RECIPE.toml --mode offline --source vllm --engine-url http://HOST:8000
       torchrun --nproc-per-node 8 -m eyas.cli train --config RECIPE.toml      (several GPUs)

Stages: synth (Magpie prompts) -> regen (target writes the replies) -> vocab (draft vocabulary) ->
capture (offline features; only with [train] mode = "offline") -> fit -> export -> eval.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

from eyas.errors import EyasError
from eyas.paths import creatable_dir

STAGES = ("all", "synth", "regen", "vocab", "capture", "fit", "export", "eval")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stage", nargs="?", default="all", choices=STAGES,
                        help="run one stage alone (default: all of them, in order)")
    parser.add_argument("--config", required=True, metavar="RECIPE.toml", help="the training recipe")
    parser.add_argument("--device", help="cuda, cpu, cuda:1 ... (default: the recipe's, auto = cuda if available)")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: the recipe's out_dir)")
    parser.add_argument("--num-samples", type=int, metavar="N",
                        help="regenerate and train on at most N prompts' conversations (plus their "
                             "[regen] sampled_copies), and synthesize no more prompts than that needs")
    parser.add_argument("--steps", type=int, metavar="N", help="optimizer steps")
    parser.add_argument("--mode", choices=("online", "offline"), help="online: target per batch; offline: features on disk")
    parser.add_argument("--source", choices=("eyas", "vllm", "sglang"),
                        help="capture: the engine computing the target's hidden states (default: the recipe's "
                             "[capture] source; vllm and sglang need --engine-url and --mode offline)")
    parser.add_argument("--engine-url", metavar="URL", help="capture: the vLLM or SGLang server's base URL")
    parser.add_argument("--engine-hidden-url", metavar="URL",
                        help="capture from sglang: a second server, of the target alone, for the final hidden states")
    parser.add_argument("--sharegpt", action="append", default=[], metavar="FILE",
                        help="add a ShareGPT/OpenAI-messages conversation file to the prompts (repeatable)")
    parser.add_argument("--layouts", nargs="+", choices=("sglang", "eagle", "speculators"),
                        help="export layouts (default: the recipe's)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any recipe value, e.g. --set train.lr=3e-4 (value in TOML syntax)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--profile", action="store_true",
                        help="synth and regen: time the engine's prefill and decode steps, printed after the stage")


def _toml_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string


def overrides_from(args) -> dict:
    out = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise EyasError(f"--set expects SECTION.KEY=VALUE, got '{item}'")
        out[key.strip()] = _toml_value(value.strip())
    for key, value in (("device", args.device), ("out_dir", args.out), ("train.steps", args.steps),
                       ("train.mode", args.mode), ("export.layouts", args.layouts),
                       ("capture.source", args.source), ("capture.url", args.engine_url),
                       ("capture.hidden_url", args.engine_hidden_url)):
        if value is not None:
            out[key] = value
    return out


def _check_paths(recipe, stage: str) -> None:
    """What the stages would find wrong only after the earlier ones ran (synth can take hours): checked first."""
    from eyas.train.prompts import as_prompt, read_conversations

    for f in recipe.data.sharegpt:
        if not Path(f).is_file():
            raise EyasError(f"conversation file {f} ({'a directory' if Path(f).is_dir() else 'not found'}): "
                            "[data] sharegpt and --sharegpt take JSON or JSONL files")
        # Only regen reads them; a stage run alone after it need not parse a large file again.
        if stage in ("all", "regen") and not any(as_prompt(c, 1) for c in read_conversations(f)):
            raise EyasError(f"conversation file {f} has no conversation with a user turn")
    out = recipe.out
    if out.exists() and not out.is_dir():
        raise EyasError(f"output directory {out} is a regular file")
    creatable_dir(out)


def run(args) -> int:
    from eyas.train.pipeline import Pipeline
    from eyas.train.recipe import load_recipe

    recipe = load_recipe(args.config, overrides_from(args))
    if args.sharegpt:
        recipe.data.sharegpt = list(recipe.data.sharegpt) + list(args.sharegpt)
    if args.num_samples is not None:
        if args.num_samples < 1:
            raise EyasError(f"--num-samples must be >= 1, got {args.num_samples}")
        recipe.regen.max_samples = args.num_samples
        # Held-out prompts in proportion: a quick run of 8 samples should not synthesize 64 held-out ones.
        heldout = min(recipe.data.heldout, max(2, args.num_samples // 4))
        if heldout != recipe.data.heldout:
            print(f"eyas train: --num-samples {args.num_samples}: holding out {heldout} prompts, not [data] heldout = "
                  f"{recipe.data.heldout}", file=sys.stderr)
            recipe.data.heldout = heldout
        if recipe.synth.num:
            recipe.synth.num = min(recipe.synth.num, args.num_samples + recipe.data.heldout)
    _check_paths(recipe, args.stage)
    Pipeline(recipe, progress=not args.no_progress, profile=args.profile).run([args.stage],
                                                                             argv=getattr(args, "argv", []))
    return 0
