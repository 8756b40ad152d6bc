"""`eyas draft`: convert an EAGLE-3 draft between the engines' layouts, or check how each engine will run it.

Usage:
    eyas draft convert DRAFT OUT --layout eagle|sglang|speculators [--target MODEL] [--speculative-tokens N]
    eyas draft check DRAFT [--target MODEL] [--sglang-algorithm EAGLE3] [--vllm-method eagle3]

`check` exits 1 when it finds a problem (printed as PROBLEM lines, naming the engines it affects).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eyas.errors import EyasError

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    c = sub.add_parser("convert", help="write the draft in another engine's layout")
    c.add_argument("src", metavar="DRAFT", help="the draft directory (any layout)")
    c.add_argument("out", metavar="OUT", help="the directory to write (replaced atomically)")
    c.add_argument("--layout", required=True, choices=("eagle", "sglang", "speculators"),
                   help="eagle: SafeAILab/EAGLE; sglang: SGLang/SpecForge (also vLLM); speculators: vllm-project")
    c.add_argument("--target", metavar="MODEL",
                   help="the target (directory or 'demo'): checked to fit; speculators gets its embedding and path")
    c.add_argument("--speculative-tokens", type=int, metavar="N",
                   help="the proposal length the speculators layout records (default: the source's)")
    c.add_argument("--dtype", choices=tuple(DTYPES), help="weight dtype to write (default: the source's)")
    k = sub.add_parser("check", help="the draft's layout, flags, engines, capture layers and misconfigurations")
    k.add_argument("draft", metavar="DRAFT", help="the draft directory")
    k.add_argument("--target", metavar="MODEL", help="the target (directory or 'demo'): check the fit and layers")
    k.add_argument("--sglang-algorithm", metavar="ALGO", help="the --speculative-algorithm you launch SGLang with")
    k.add_argument("--vllm-method", metavar="METHOD", help="the speculative-config method you launch vLLM with")


def _target(arg: str | None):
    if arg is None:
        return None, None
    from eyas.config import ModelConfig
    from eyas.models.demo import resolve_model_path

    path = resolve_model_path(arg)
    return path, ModelConfig.from_dir(path)


def run(args: argparse.Namespace) -> int:
    return convert(args) if args.action == "convert" else check(args)


def check(args: argparse.Namespace) -> int:
    from eyas.models.draft_check import check_draft

    _, target = _target(args.target)
    report = check_draft(args.draft, target, args.sglang_algorithm, args.vllm_method)
    print(report.render())
    return 1 if report.problems else 0


def convert(args: argparse.Namespace) -> int:
    import torch

    from eyas.models.draft_check import weight_dtypes
    from eyas.models.draft_io import load_draft, read_draft_tensors, save_draft

    src, out = Path(args.src), Path(args.out)
    if src.resolve() == out.resolve():
        raise EyasError("OUT must differ from DRAFT (the conversion reads DRAFT while it writes)")
    if args.speculative_tokens is not None and args.speculative_tokens < 1:
        raise EyasError(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}")
    target_path, target = _target(args.target)
    draft = load_draft(src, target)
    if args.dtype:
        dtype = getattr(torch, DTYPES[args.dtype])
    else:
        stored = {v for k, v in weight_dtypes(src).items() if k.endswith("weight")}
        names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
        kinds = {names.get(s, s) for s in stored}
        if len(kinds) != 1 or next(iter(kinds)) not in DTYPES.values():
            raise EyasError(f"the source's weights are {', '.join(sorted(kinds))}: give --dtype")
        dtype = getattr(torch, kinds.pop())
    embedding = read_draft_tensors(src).get("embed_tokens.weight")
    if target_path is not None and args.layout == "speculators":
        from eyas.train.target import TargetHeads

        embedding = TargetHeads.load(target_path, torch.float32, "cpu").embed_weight
    verifier = str(target_path.resolve()) if target_path is not None else None
    save_draft(draft, out, args.layout, verifier=verifier, dtype=dtype, speculative_tokens=args.speculative_tokens,
               embedding=embedding if args.layout == "speculators" else None)
    print(f"wrote {out} ({args.layout} layout, {str(dtype).removeprefix('torch.')})")
    if args.layout == "speculators" and (embedding is None or verifier is None):
        print("note: speculators' own loader needs the target's embedding and path: convert with --target MODEL")
    return 0


def check_before_launch(draft: str | None, model: str, backend: str) -> None:
    """The draft check `eyas launch` runs before it starts a server: the first problem for `backend` is an error.
    Paths that are not on this machine (a remote launch) are left to the server."""
    if not draft or not Path(draft).is_dir():
        return
    from eyas.config import ModelConfig
    from eyas.models.draft_check import check_draft

    target = None
    if model == "demo" or (Path(model) / "config.json").is_file():
        from eyas.models.demo import resolve_model_path

        try:
            target = ModelConfig.from_dir(resolve_model_path(model))
        except EyasError:  # a target this machine cannot read is the server's to refuse; check the draft alone
            target = None
    errors = check_draft(draft, target).errors(backend)
    if errors:
        raise EyasError(f"draft {draft}: {errors[0]} (eyas draft check {draft} says more)")
