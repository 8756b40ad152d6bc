"""Decode step vs speculative-cycle phases on MoE and MLA targets (random weights, random EAGLE-3 draft), one GPU.

Usage: python benchmarks/bench_moe_mla.py --models qwen3moe,deepseek,llama8b --batches 1,16 --out moe_mla.json
       OMP_NUM_THREADS=1 python benchmarks/bench_moe_mla.py --device cpu --tiny   # smoke test of the script

Models keep their real per-layer shapes: Qwen3-30B-A3B (all 48 layers, 128 experts top-8), DeepSeek-V3 cut to
its first 5 of 61 layers (the 3 dense ones + 2 MoE layers with all 256 experts, so ~53 GB of bf16 weights fit
beside everything else), and dense Llama-3.1-8B for comparison. `--layers 6` or `--layers deepseek=6` overrides.

Per model and batch size: the engine's plain decode step (forward, logits, greedy sample, one host copy) and one
speculative cycle's phases from engine/profile.py (draft, verify, accept, commit), with the acceptance length
(about 1 with a random draft: the point is the phase times), the weight bytes, which expert path ran (counted
during prefill and the first cycle, not inferred), which phases replayed CUDA graphs, and a memory-bandwidth floor.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from collections import Counter
from types import SimpleNamespace
from unittest.mock import patch

import torch

from bench_tp import LLAMA_8B, copy_bandwidth  # benchmarks/ (the script's own folder is on sys.path)
from eyas.config import ModelConfig, SpecConfig
from eyas.engine.engine import Engine
from eyas.engine.graphs import BATCH_BUCKETS
from eyas.engine.profile import Profiler
from eyas.layers.sampling import SamplingParams
from eyas.models.eagle3 import Eagle3Draft
from eyas.models.llama import CausalLM
from eyas.models.moe import Experts
from eyas.train.draft_init import draft_config_for
from timing import median_ms

QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
                 rope_theta=1e6, max_position_embeddings=40960)
DEEPSEEK_V3 = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                   first_k_dense_replace=3, moe_layer_freq=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   scoring_func="sigmoid", topk_method="noaux_tc", rms_norm_eps=1e-6, rope_theta=10000.0,
                   rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                                     beta_slow=1, mscale=1.0, mscale_all_dim=1.0), max_position_embeddings=163840)
MODELS = dict(qwen3moe=(QWEN3_MOE, 48), deepseek=(DEEPSEEK_V3, 5), llama8b=(LLAMA_8B, 32))  # hf config, default layers
# --tiny: every width small, the structure (routing kind, dense-then-sparse layers, MLA) kept.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
DRAFT_VOCAB = 32000  # EAGLE-3's usual reduced vocabulary


def hf_config(name: str, layers: int, tiny: bool) -> dict:
    hf, _ = MODELS[name]
    hf = dict(hf, num_hidden_layers=layers)
    if tiny:
        hf.update({k: v for k, v in TINY.items() if k in hf})
        if "kv_lora_rank" in hf:
            hf["num_key_value_heads"] = hf["num_attention_heads"]
    return hf


def scaling_note(name: str, cfg: ModelConfig) -> str:
    full = MODELS[name][0]["num_hidden_layers"]
    moe, dense = len(cfg.moe_layers), cfg.num_layers - len(cfg.moe_layers)
    layers = f"{cfg.num_layers} of {full} layers" + (f" ({dense} dense + {moe} MoE)" if moe and dense else "")
    return layers + (f", {cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if moe else "")


def random_init(module: torch.nn.Module, dtype: torch.dtype, device) -> torch.nn.Module:
    """Materialize a meta-built module directly in `dtype` (a 60 GB model never exists in fp32), then fill it:
    norms at 1, routing biases at 0, every matrix N(0, 0.02); routers stay fp32 as the loader keeps them."""
    module = module.to(dtype)
    for m in module.modules():
        if getattr(m, "keep_fp32", False):
            m.float()
    module = module.to_empty(device=device)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                p.fill_(1.0)
            elif n.endswith("e_score_correction_bias"):
                p.zero_()
            else:
                p.normal_(0, 0.02)
    for m in module.modules():
        if hasattr(m, "reset_buffers"):  # the rotary tables
            m.reset_buffers()
    return module.eval().requires_grad_(False)


def build(cfg: ModelConfig, dtype, device, max_len: int):
    with torch.device("meta"):
        target = CausalLM(cfg, max_positions=max_len)
        section = SimpleNamespace(aux_layer_ids=[], draft_vocab_size=min(DRAFT_VOCAB, cfg.vocab_size // 2),
                                  intermediate_size=None, rope_theta=10000.0)
        draft = Eagle3Draft(draft_config_for(cfg, section), max_positions=max_len + 64)
    target, draft = random_init(target, dtype, device), random_init(draft, dtype, device)
    used = torch.randperm(cfg.vocab_size, device=device)[:draft.config.draft_vocab_size].sort().values
    draft.d2t.copy_(used - torch.arange(used.numel(), device=device))
    draft.t2d.zero_()
    draft.t2d[used] = True
    return target, draft


def nbytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def plain_step(eng: Engine, seqs):
    """The engine's plain decode step (engine.py `decode`) without its bookkeeping, so it can be repeated."""
    ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=eng.device)
    starts = [s.cached for s in seqs]
    out = eng.runner.forward(ids, torch.tensor(starts, device=eng.device)[:, None], [s.slot for s in seqs], starts)
    return eng.sample(eng.target.logits(out.hidden[:, -1]), seqs).tolist()


def bytes_floor(cfg: ModelConfig, target, tokens: int, context_tokens: int, kv_bytes_per_token: int) -> int:
    """Bytes one forward of `tokens` tokens must read: every weight but the embedding, except that each MoE layer
    reads only the experts its tokens touch (expected count under uniform routing), plus the cached context."""
    skip = sum(p.numel() * p.element_size() for n, p in target.named_parameters()
               if "embed_tokens" in n or ".experts." in n)
    total = nbytes(target) - skip
    if cfg.moe_layers:
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        per_expert = nbytes(target.model.layers[cfg.moe_layers[0]].mlp.experts) / E
        total += len(cfg.moe_layers) * E * (1 - (1 - k / E) ** tokens) * per_expert
    return int(total + context_tokens * kv_bytes_per_token)


def expert_paths(run) -> str:
    """Run `run()` and name the expert path(s) it took: counted calls, not inferred from device and dtype."""
    counts = Counter()

    def counted(name, fn):
        def wrapper(self, *args):
            counts[name] += 1
            return fn(self, *args)
        return wrapper

    with patch.object(Experts, "forward_grouped", counted("grouped", Experts.forward_grouped)), \
            patch.object(Experts, "forward_reference", counted("reference", Experts.forward_reference)):
        run()
    return "+".join(k for k, v in counts.items() if v) or "none (dense)"


def bench_batch(eng: Engine, B: int, prompt_len: int, cycles: int, reps: int, cuda: bool) -> dict:
    g = torch.Generator().manual_seed(B)
    prompts = [torch.randint(0, eng.config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(B)]
    params = SamplingParams(max_tokens=(cycles + 8) * eng.decoder.lookahead, ignore_eos=True)
    seqs = [eng.add(p, params) for p in prompts]
    paths = expert_paths(eng.step)  # admit + eager prefill of all B, then the first cycle (captures its graphs)
    for _ in range(2):
        eng.step()
    plain = median_ms(lambda: plain_step(eng, seqs), reps=reps, cuda=cuda)
    eng.profiler = Profiler(eng.device)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(cycles):
        eng.step()
    if cuda:
        torch.cuda.synchronize()
    cycle = (time.perf_counter() - t0) / cycles * 1e3
    s = eng.profiler.summary()
    for seq in seqs:
        eng.abort(seq)
    row = dict(batch=B, context=prompt_len, plain_decode_ms=plain, cycle_ms=cycle, accept_length=s["accept_length"],
               expert_path=paths)
    row.update({f"{k}_ms": v["p50_ms"] for k, v in s["phases"].items()})
    row["tok_s_plain"] = B * 1e3 / plain
    row["tok_s_spec"] = B * s["accept_length"] * 1e3 / cycle
    return row


def eager_forwards(eng: Engine, B: int) -> str:
    """The cycle's forwards that did not replay a CUDA graph at batch B (prefill and accept always run eagerly)."""
    g = eng.runner.graphs
    if g is None:
        return "all (no CUDA graphs)"
    bucket = next(b for b in BATCH_BUCKETS if b >= B)
    N = eng.decoder.spec.draft_tokens
    captured = dict(decode=any(k[:4] == ("target", bucket, 1, False) for k in g.graphs),
                    verify=any(k[:4] == ("target", bucket, N, True) for k in g.graphs),
                    draft=any(k[:2] == ("tree", bucket) for k in g.graphs),
                    extend=any(k[:2] == ("extend", bucket) for k in g.graphs))
    return ",".join(k for k, v in captured.items() if not v) or "none"


def bench_model(name: str, args, bw: float | None) -> list[dict]:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    layers = args.layers.get(name, args.layers.get("*", 4 if args.tiny and name != "deepseek" else MODELS[name][1]))
    cfg = ModelConfig.from_hf(hf_config(name, layers, args.tiny))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    target, draft = build(cfg, dtype, args.device, args.max_len)
    for m in target.modules():
        if isinstance(m, Experts):
            m.grouped = dict(auto=None, grouped=True, reference=False)[args.expert_path]
    built_s = time.perf_counter() - t0
    # Engine reads the target from disk; hand it the in-memory random one instead (the draft it takes as is).
    with patch("eyas.engine.engine.load_model", return_value=target):
        eng = Engine(f"random:{name}", dtype=args.dtype, device=args.device, draft=draft, spec=args.spec,
                     max_batch=max(args.batches), max_len=args.max_len, profiler=Profiler(args.device))
    heads, head_dim, shared = cfg.kv_cache_layout(1)
    kv_per_token = (1 if shared else 2) * cfg.num_layers * heads * head_dim * dtype.itemsize
    info = dict(model=name, scaling=scaling_note(name, cfg), weights_gb=nbytes(target) / 1e9,
                draft_gb=nbytes(draft) / 1e9, kv_cache_gb=eng.runner.kv.bytes() / 1e9, build_s=built_s,
                gpu_allocated_gb=torch.cuda.memory_allocated() / 1e9 if cuda else None)
    rows = []
    for B in args.batches:
        t0 = time.perf_counter()
        row = dict(info, **bench_batch(eng, B, args.context, args.cycles, args.reps, cuda))
        if bw:
            N = eng.decoder.spec.draft_tokens
            row["decode_floor_ms"] = bytes_floor(cfg, target, B, B * args.context, kv_per_token) / bw * 1e3
            row["verify_floor_ms"] = bytes_floor(cfg, target, B * N, B * args.context, kv_per_token) / bw * 1e3
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
    for r in rows:
        r["eager_forwards"] = eager_forwards(eng, r["batch"])
        r["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    del eng, target, draft  # the engine and its decoder point at each other: collect before emptying the cache
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        print(f"freed {name}: {torch.cuda.memory_allocated() / 1e9:.2f} GB still allocated", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    cols = [("model", "model", "{}"), ("B", "batch", "{}"), ("weights GB", "weights_gb", "{:.1f}"),
            ("experts", "expert_path", "{}"), ("decode ms", "plain_decode_ms", "{:.2f}"),
            ("floor ms", "decode_floor_ms", "{:.2f}"), ("draft ms", "draft_ms", "{:.2f}"),
            ("verify ms", "verify_ms", "{:.2f}"), ("verify floor", "verify_floor_ms", "{:.2f}"),
            ("accept ms", "accept_ms", "{:.2f}"), ("commit ms", "commit_ms", "{:.2f}"),
            ("cycle ms", "cycle_ms", "{:.2f}"), ("accept len", "accept_length", "{:.2f}"),
            ("verify/decode", None, "{:.2f}"), ("eager forwards", "eager_forwards", "{}")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for _, key, fmt in cols:
            v = r["verify_ms"] / r["plain_decode_ms"] if key is None else r.get(key)
            cells.append("-" if v is None else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3moe,deepseek,llama8b")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--layers", default="", help="N for every model, or name=N,... (default: qwen3moe 48, deepseek 5, llama8b 32)")
    ap.add_argument("--spec", default="3,1,4", help="steps,topk,draft_tokens (SGLang's meaning); 5,4,8 for a tree")
    ap.add_argument("--expert-path", default="auto", choices=["auto", "grouped", "reference"],
                    help="auto: grouped for bf16 on CUDA, the reference loop elsewhere (models/moe.py)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per sequence (default 300, tiny 32)")
    ap.add_argument("--cycles", type=int, default=None, help="timed speculative cycles (default 20, tiny 3)")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a CPU smoke run of the script itself")
    ap.add_argument("--out", default="bench_moe_mla.json")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.layers = {(k if v else "*"): int(v or k) for k, _, v in (x.partition("=") for x in args.layers.split(",") if x)}
    args.spec = SpecConfig(*map(int, args.spec.split(",")), adaptive=False)
    args.context = args.context or (32 if args.tiny else 300)
    args.cycles = args.cycles or (3 if args.tiny else 20)
    args.reps = 3 if args.tiny else 20
    args.max_len = 256 if args.tiny else 1024
    cuda = args.device == "cuda"
    bw = copy_bandwidth() if cuda else None
    results = dict(kernels=os.environ.get("EYAS_KERNELS", "1"), gpu=torch.cuda.get_device_name() if cuda else "cpu",
                   torch=torch.__version__,
                   date=time.strftime("%Y-%m-%d"), tiny=args.tiny, dtype=args.dtype,
                   spec=dict(steps=args.spec.steps, topk=args.spec.topk, draft_tokens=args.spec.draft_tokens),
                   copy_bw_tb_s=bw / 1e12 if bw else None, rows=[], failed={})
    t0 = time.perf_counter()
    for name in args.models.split(","):
        try:
            results["rows"] += bench_model(name, args, bw)
        except Exception as e:  # one model's failure (a kernel this GPU lacks, say) must not lose the others' numbers
            traceback.print_exc()
            results["failed"][name] = f"{type(e).__name__}: {e}"[:1000]
        gc.collect()  # after a failure the traceback held the model; it is gone once the except block ends
        if cuda:
            torch.cuda.empty_cache()
        json.dump(results, open(args.out, "w"), indent=2)
    results["seconds"] = time.perf_counter() - t0
    json.dump(results, open(args.out, "w"), indent=2)
    print(f"\n{results['gpu']}, {args.dtype}, spec steps/topk/tokens {args.spec.steps}/{args.spec.topk}/"
          f"{args.spec.draft_tokens}, context {args.context}, random weights and draft (acceptance ~1 by design)"
          + (f", copy bandwidth {bw / 1e12:.2f} TB/s (floors = bytes that must be read / it)" if bw else ""))
    for name in dict.fromkeys(r["model"] for r in results["rows"]):
        r = next(x for x in results["rows"] if x["model"] == name)
        mem = f", allocated {r['gpu_allocated_gb']:.1f} GB, peak {r['gpu_peak_gb']:.1f} GB" if cuda else ""
        print(f"- {name}: {r['scaling']}; weights {r['weights_gb']:.3g} GB, draft {r['draft_gb']:.3g} GB, "
              f"KV cache {r['kv_cache_gb']:.3g} GB{mem}")
    print("- eager by design: prefill (target and draft), accept (host), commit's per-sequence KV compaction; "
          "'eager forwards' lists the decode/verify/draft/extend forwards that did not replay a CUDA graph")
    print()
    print(table(results["rows"]))
    for name, err in results["failed"].items():
        print(f"FAILED {name}: {err}")
    print(f"\ntotal {results['seconds']:.0f} s; results in {args.out}")


if __name__ == "__main__":
    main()
