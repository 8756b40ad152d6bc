"""Decode speed of a Llama-3.1-8B-shaped model (random weights) at TP = 1 and 2, with and without our user's
NCCL settings, against the memory-bandwidth bound measured in the same run.

Usage: python benchmarks/bench_tp.py --tp 1,2 --out tp.json [--no-graphs] [--pdl] [--merge-in-kernel]
       [--fused-o-proj] [--shape llama-8b|smollm2] [--markdown FILE]

`decode_ms` is one step (graph replay and logits) timed from an idle GPU, the host's launch included;
`decode_steady_ms` is a step among 20 queued back to back, as an engine decoding ahead of the host runs them.
Both are reported against the bound (`fraction_of_bound`, `fraction_of_bound_steady`).

`--shape smollm2` times SmolLM2-135M's shape instead (random weights: speed does not depend on them), for the
switches that matter to small models without carrying the demo model's weights.

Every rank also times one step of a random EAGLE-3 draft for the same target (32k draft vocabulary, CUDA graph,
batch 1): eyas runs the draft replicated on every rank, from the target's features that every rank holds after
the all-reduce, so no collective is needed per draft step; running it on rank 0 alone would instead add a
broadcast of the drafted tokens per cycle, timed here as `broadcast_tree_ms`.

Each configuration starts its workers with torch.multiprocessing (spawn) after setting the environment,
and every worker reports the NCCL_* variables it really has, so the report proves which settings ran.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from md_tables import run_header, table, writable  # benchmarks/md_tables.py
from timing import kernel_table, median_ms  # benchmarks/timing.py (the script's own folder is on sys.path)

USER_NCCL = dict(NCCL_PROTO="LL", NCCL_ALGO="Ring", NCCL_P2P_LEVEL="SYS", NCCL_MAX_NCHANNELS="16",
                 NCCL_BUFFSIZE="16777216", NCCL_NTHREADS="512")
LLAMA_8B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=8192,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192))
CONTEXT = 512
STEADY_STEPS = 20  # decode steps per timed sample of the steady figure (decode_steady_ms)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    a = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), reps=10)
    return 2 * a.numel() / (ms / 1e3)


def worker(rank, tp, port, queue, graphs=True, shape=LLAMA_8B, context=CONTEXT, plan=None):
    """Report results, or the traceback: a silent failure in one rank would leave the others (and us) waiting.
    `plan`: execution_plan.using's keywords for this rank (a spawned process starts with the default plan)."""
    from eyas import execution_plan

    try:
        with execution_plan.using(**(plan or {})):
            _worker(rank, tp, port, queue, graphs, shape, context)
    except BaseException:
        import traceback
        queue.put({"rank": rank, "error": traceback.format_exc()})
        raise


def _worker(rank, tp, port, queue, graphs, shape, context):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=tp, device_id=torch.device("cuda", rank))
    from eyas.tensor_parallel import TPContext
    from eyas.engine.graphs import CudaGraphs

    cfg, model, runner = random_runner(shape, TPContext(rank, tp, dist.group.WORLD), context)
    if graphs:
        runner.graphs = CudaGraphs(runner)
    res = {}
    for T in (1, 3, 4, 8):
        x = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
        pos = torch.arange(context, context + T, device="cuda")[None]
        mask = None if T == 1 else torch.tril(torch.ones(T, T, dtype=torch.bool, device="cuda"))[None]
        res[f"T{T}_ms"] = median_ms(lambda: model.logits(runner.forward(x, pos, [0], [context], new_mask=mask).hidden))
        if T == 1:  # steps back to back, no wait between them: what decoding ahead of the host sees per step
            res["T1_steady_ms"] = median_ms(lambda: [model.logits(runner.forward(x, pos, [0], [context]).hidden)
                                                     for _ in range(STEADY_STEPS)], reps=10) / STEADY_STEPS
    if rank == 0 and tp == 1 and graphs:  # where a decode step's GPU time goes, kernel by kernel
        x, pos = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda"), torch.tensor([[context]], device="cuda")
        res["decode_kernels"] = kernel_table(lambda: model.logits(runner.forward(x, pos, [0], [context]).hidden))
    res["draft_step_ms"] = draft_step_ms(cfg)
    if tp > 1:  # what a draft on rank 0 alone would add per cycle: sending the 8 tree tokens to the others
        tree = torch.zeros(1, 8, dtype=torch.long, device="cuda")
        res["broadcast_tree_ms"] = median_ms(lambda: dist.broadcast(tree, src=0))
    # all-reduce cost of one decode pass: 2 per layer of [1, hidden] bf16
    buf = torch.randn(1, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    if tp > 1:
        res["allreduce_per_pass_ms"] = median_ms(lambda: [dist.all_reduce(buf) for _ in range(2 * cfg.num_layers)])
    if rank == 0:
        # A decode step reads every weight once, except the embedding table (one row per token).
        params = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
        kv_bytes = 2 * cfg.num_layers * (cfg.num_kv_heads // tp) * context * cfg.head_dim * 2
        res.update(weight_bytes_per_rank=params, kv_bytes_per_rank=kv_bytes, copy_bw=copy_bandwidth(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    res["env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    res["graphs"] = graphs
    res["rank"], res["pid"] = rank, os.getpid()
    queue.put(res)
    # No barrier or destroy_process_group: after NCCL collectives were captured in a CUDA graph,
    # destroy_process_group can hang (pytorch/pytorch#115388); exiting frees the communicators.


def random_runner(shape: dict, ctx, context: int, max_len: int = 2048):
    """(config, model, runner): a random-weight bf16 model of HF config `shape` on this rank's GPU (TP context
    `ctx`), its runner for one sequence, and `context` random tokens prefilled eagerly into its cache."""
    from eyas.config import ModelConfig
    from eyas.engine.runner import ModelRunner
    from eyas.models.llama import CausalLM

    cfg = ModelConfig.from_hf(shape)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = CausalLM(cfg, ctx, max_positions=max_len)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    model.model.rotary.reset_buffers()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.eval().requires_grad_(False)
    runner = ModelRunner(model, 1, max_len, "cuda")
    ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")
    runner.forward(ids, torch.arange(context, device="cuda")[None], [0], [0])  # prefill eagerly
    return cfg, model, runner


def draft_step_ms(cfg, device="cuda") -> float:
    """One draft step at batch 1 (decode-shaped: one token, 512 cached columns, logits and top-k), replayed
    from a CUDA graph; the draft is sized as `eyas train` would make it for this target."""
    from types import SimpleNamespace

    from eyas.engine.graphs import capture
    from eyas.layers.kv_cache import KVCache
    from eyas.layers.attention import AttentionBatch
    from eyas.models.eagle3 import Eagle3Draft
    from eyas.train.draft_init import draft_config_for

    section = SimpleNamespace(aux_layer_ids=[], draft_vocab_size=32000, intermediate_size=None, rope_theta=10000.0)
    dev = torch.device(device)
    draft = Eagle3Draft(draft_config_for(cfg, section), max_positions=2048).to(dev, torch.bfloat16)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.02)
    draft.eval().requires_grad_(False).fuse_projections()
    heads, head_dim, shared = draft.config.kv_cache_layout()
    kv = KVCache(1, 2, 2048, heads, head_dim, torch.bfloat16, dev, shared)
    slots, starts = torch.zeros(1, dtype=torch.long, device=dev), torch.full((1,), CONTEXT, device=dev)
    embeds = torch.randn(1, 1, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
    hidden = torch.randn_like(embeds)
    pos = starts[:, None].clone()

    def step():
        batch = AttentionBatch(kv=kv, slots=slots, starts=starts, kv_len=CONTEXT + 1)
        out = draft(embeds, hidden, pos, batch)
        return torch.log_softmax(draft.logits(out), dim=-1).topk(1, dim=-1)

    with torch.no_grad():
        if dev.type != "cuda":
            return median_ms(step, cuda=False)
        graph, _ = capture(step, torch.cuda.graph_pool_handle())
        return median_ms(graph.replay)


def run_config(tp, env, graphs=True, timeout_s=240, shape=LLAMA_8B, context=CONTEXT, plan=None):
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = 29500 + int(time.time() * 1000) % 1000
        procs = [ctx.Process(target=worker, args=(r, tp, port, q, graphs, shape, context, plan)) for r in range(tp)]
        for p in procs:
            p.start()
        results = []
        try:
            for _ in procs:
                results.append(q.get(timeout=timeout_s))
                if "error" in results[-1]:
                    raise RuntimeError(f"rank {results[-1]['rank']} failed:\n{results[-1]['error']}")
        except Exception as e:
            for p in procs:
                p.kill()
            return dict(tp=tp, graphs=graphs, failed=str(e) or f"no result within {timeout_s} s")
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # results are in; a rank stuck in teardown must not hold the benchmark
                p.kill()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    results.sort(key=lambda r: r["rank"])
    r0 = results[0]
    out = dict(tp=tp, graphs=r0["graphs"], decode_ms=r0["T1_ms"], decode_tok_s=1e3 / r0["T1_ms"],
               verify3_over_decode=r0["T3_ms"] / r0["T1_ms"], verify4_over_decode=r0["T4_ms"] / r0["T1_ms"],
               verify8_over_decode=r0["T8_ms"] / r0["T1_ms"], T3_ms=r0["T3_ms"], T4_ms=r0["T4_ms"], T8_ms=r0["T8_ms"],
               allreduce_per_pass_ms=r0.get("allreduce_per_pass_ms"), nccl=r0["nccl"],
               draft_step_ms=[r["draft_step_ms"] for r in results], broadcast_tree_ms=r0.get("broadcast_tree_ms"),
               draft_over_decode=r0["draft_step_ms"] / r0["T1_ms"],
               decode_kernels=r0.get("decode_kernels"),
               worker_env=[{"rank": r["rank"], "pid": r["pid"], **r["env"]} for r in results])
    bound_ms = (r0["weight_bytes_per_rank"] + r0["kv_bytes_per_rank"]) / r0["copy_bw"] * 1e3
    out.update(bandwidth_bound_ms=bound_ms, fraction_of_bound=bound_ms / r0["T1_ms"], copy_bw_tb_s=r0["copy_bw"] / 1e12)
    # decode_ms times one step from an idle GPU, so the host's work before the graph starts is in it; an
    # engine decoding ahead of the host queues the next step while one runs, as the steady figure does.
    out.update(decode_steady_ms=r0["T1_steady_ms"], fraction_of_bound_steady=bound_ms / r0["T1_steady_ms"])
    return out


def markdown_report(header: str, shape: str, context: int, rows: list[dict]) -> str:
    """The run's rows as markdown tables: each configuration against its bandwidth bound and the cost of
    verifying 4 and 8 tokens, then the first configuration's decode step kernel by kernel."""
    cells = []
    for r in rows:
        verify = [f"{r[k]:.3f}×" if r.get(k) is not None else ""
                  for k in ("verify4_over_decode", "verify8_over_decode")]
        cells.append([r["tp"], r.get("variant", "default"), f"{r['decode_ms']:.3f}", f"{r['decode_steady_ms']:.3f}",
                      f"{r['bandwidth_bound_ms']:.3f} ({r['copy_bw_tb_s']:.2f} TB/s)",
                      f"{r['fraction_of_bound']:.1%}", f"{r['fraction_of_bound_steady']:.1%}", *verify,
                      int((r.get("decode_kernels") or {}).get("kernels", 0)) or ""])
    parts = [header, f"{shape}, random weights, batch 1, {context} cached tokens; ms per decode step:",
             table(["TP", "variant", "decode", "steady", "bound (copy bandwidth)", "of bound", "steady of bound",
                    "verify 4 / decode", "verify 8 / decode", "kernels"], cells)]
    top = (rows[0].get("decode_kernels") or {}).get("top") if rows else None
    if top:
        parts += ["Where the first row's decode step goes (µs per step):",
                  table(["kernel", "calls", "µs"], [[k["name"], int(k["calls"]), f"{k['us']:,.1f}"] for k in top])]
    return "\n\n".join(parts) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--out", default="tp.json")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode (isolates NCCL-in-graph problems)")
    ap.add_argument("--pdl", action="store_true", help="each TP size with and without (plan: pdl=False) PDL, twice")
    ap.add_argument("--merge-in-kernel", action="store_true",
                    help="each TP size with the split merge in the attention kernel and without "
                         "(plan: merge_in_kernel=False), twice")
    ap.add_argument("--fused-o-proj", action="store_true",
                    help="each TP size also with a small model's attention output projection through cuBLAS instead "
                         "of the fused kernels' tiles at 1-2 rows (plan: fused_o_proj=False), twice")
    ap.add_argument("--short-row-splits", action="store_true",
                    help="each TP size also with rows of up to 512 columns attended in one pass "
                         "(plan: short_row_splits=False), twice")
    ap.add_argument("--shape", choices=("llama-8b", "smollm2"), default="llama-8b")
    ap.add_argument("--context", type=int, default=CONTEXT,
                    help="cached tokens before the timed steps (default 512: past the attention's short-row bound, "
                         "512 columns)")
    ap.add_argument("--markdown", default="", help="also write the rows as markdown tables to this file, "
                    "rewritten as each row is measured (for docs/BENCHMARKS.md)")
    args = ap.parse_args()
    writable(args.out, "bench_tp")
    writable(args.markdown, "bench_tp")
    if not 1 <= args.context <= 2000:
        raise SystemExit(f"bench_tp: --context {args.context} is not in 1..2000")
    header = run_header("cuda") if args.markdown else ""  # git and a transformers import: only for the tables
    if args.shape == "smollm2":
        from bench_join import SMOLLM2  # benchmarks/bench_join.py: SmolLM2-135M's config
        shape = SMOLLM2
    else:
        shape = LLAMA_8B
    rows = []
    for tp in map(int, args.tp.split(",")):
        # (name, environment, execution plan changes) per configuration
        variants = [("default", {}, {})] + ([("user_nccl", USER_NCCL, {})] if tp > 1 else [])
        switches = ([("pdl_off", {}, {"pdl": False})] if args.pdl else []) \
            + ([("merge_kernel", {}, {"merge_in_kernel": False})] if args.merge_in_kernel else [])
        if args.pdl and args.merge_in_kernel:
            switches.append(("pdl_off+merge_kernel", {}, {**switches[0][2], **switches[1][2]}))
        if args.short_row_splits:
            switches.append(("short_rows_one_pass", {}, {"short_row_splits": False}))
        if args.fused_o_proj:
            switches.append(("cublas_o_proj", {}, {"fused_o_proj": False}))
        if switches:  # each switch beside the default, in turn, twice: A B (C D) A B (C D)
            variants = ([("default", {}, {})] + switches) * 2
        for name, env, plan in variants:
            r = run_config(tp, env, graphs=not args.no_graphs, shape=shape, context=args.context, plan=plan)
            r["plan"] = plan
            r["variant"] = name  # default, user_nccl (our user's NCCL settings), or a switch's name
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "worker_env"}), flush=True)
            print("  worker env:", json.dumps(r.get("worker_env")), flush=True)
            if args.markdown:
                with open(args.markdown, "w") as f:
                    f.write(markdown_report(header, args.shape, args.context, rows))
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, shape=args.shape, context=args.context,
                   rows=rows),
              open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
