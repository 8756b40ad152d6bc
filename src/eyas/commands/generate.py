"""eyas generate: one prompt through a target model, optionally with an EAGLE-3 draft.

Usage: eyas generate --model demo --chat --prompt "Name three birds of prey." --max-tokens 64 --temperature 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eyas.errors import EyasError


def add_arguments(p):
    p.add_argument("--model", required=True, help="HF checkpoint directory, or 'demo'")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    p.add_argument("--chat", action="store_true", help="apply the chat template to the prompt as one user turn")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches this (default 1: all)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default 0: no limit)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling draws, for reproducible output")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--draft", help="EAGLE-3 draft directory (EAGLE, SGLang or speculators layout)")
    p.add_argument("--spec-steps", type=int, default=None, help="draft depth (default 3)")
    p.add_argument("--spec-topk", type=int, default=None, help="branching per step (default 1 = chain)")
    p.add_argument("--spec-draft-tokens", type=int, default=None, help="tokens sent to verify, root included")
    p.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="speculate only where it measures more tokens/s than plain decoding (on by default with "
                        "--draft, as in eyas serve; --no-spec-adaptive speculates at every step)")
    p.add_argument("--profile", action="store_true", help="time every speculative cycle's phases")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every forward eagerly on CUDA (no graphs)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def read_prompt_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EyasError(f"--prompt-file {path} is not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x})") from None
    except OSError as e:
        raise EyasError(f"cannot read --prompt-file {path}: {e.strerror}") from None


def check_draft_dir(draft: str | None) -> None:
    """A missing or mistyped --draft is named as the draft, before the target loads."""
    if draft is None:
        return
    path = Path(draft)
    if not path.exists():
        raise EyasError(f"draft directory not found: {path}")
    if not path.is_dir():
        raise EyasError(f"--draft {path} is not a directory")


def run(args) -> int:
    import torch

    from eyas.config import ModelConfig, SpecConfig
    from eyas.engine.engine import Engine
    from eyas.engine.profile import Profiler
    from eyas.layers.sampling import SamplingParams
    from eyas.models.demo import resolve_model_path
    from eyas.models.tokenizer import encode_prompt, load_tokenizer

    if args.device == "cuda" and not torch.cuda.is_available():
        raise EyasError("--device cuda was asked for but no CUDA device is available")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    text = read_prompt_file(args.prompt_file) if args.prompt_file else args.prompt
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    given = {k: v for k, v in dict(steps=args.spec_steps, topk=args.spec_topk, draft_tokens=args.spec_draft_tokens,
                                   adaptive=args.spec_adaptive).items() if v is not None}  # the others: SpecConfig's
    if given and not args.draft:
        raise EyasError("--spec-steps/--spec-topk/--spec-draft-tokens/--[no-]spec-adaptive need --draft")
    spec = SpecConfig(**given) if args.draft else None
    check_draft_dir(args.draft)
    model_path = resolve_model_path(args.model)
    # Weights first: a broken checkpoint should be reported as such, not as a tokenizer problem.
    config = ModelConfig.from_dir(model_path)
    max_len = min(config.max_position_embeddings, 4096)
    margin = spec.draft_tokens + 1 if spec else 1  # the engine's lookahead (Engine.add)
    if params.max_tokens + margin >= max_len:  # before the weights load; with the prompt, Engine.add checks it
        raise EyasError(f"--max-tokens {params.max_tokens} exceeds the context of {max_len - margin} tokens")
    profiler = Profiler(device) if args.profile else None
    engine = Engine(str(model_path), dtype=dtype, device=device, draft=args.draft, spec=spec, max_batch=1,
                    max_len=max_len, cuda_graphs=not args.no_cuda_graphs, profiler=profiler)
    tokenizer = load_tokenizer(model_path)
    prompt_ids = encode_prompt(tokenizer, text, args.chat)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    [seq] = engine.generate([prompt_ids], params)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    text_out = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
    result = {
        "text": text_out,
        "token_ids": seq.output_ids,
        "num_prompt_tokens": len(prompt_ids),
        "num_tokens": len(seq.output_ids),
        "seconds": seconds,
        "tokens_per_second": len(seq.output_ids) / seconds if seconds > 0 else 0.0,
        "finish_reason": seq.finish_reason,
        "execution_plan": engine.execution_plan_summary,
    }
    if spec:
        result.update(accept_length=seq.accept_length, verify_passes=seq.verify_passes)
        if profiler:
            result["profile"] = profiler.summary()
    if args.json:
        print(json.dumps(result))
    else:
        print(text_out)
        extra = f", acceptance length {seq.accept_length:.2f}" if spec else ""
        print(f"[{result['num_tokens']} tokens in {seconds:.2f} s, {result['tokens_per_second']:.1f} tok/s{extra}]",
              file=sys.stderr)
        if profiler:
            print(profiler.table(), file=sys.stderr)
    return 0
