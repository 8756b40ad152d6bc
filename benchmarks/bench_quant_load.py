"""Quantized checkpoints as shipped (issue #9): what loading them costs, and what it does to the logits.

Usage: OMP_NUM_THREADS=1 python benchmarks/bench_quant_load.py --out quant_load.json
       python benchmarks/bench_quant_load.py --device cuda --out quant_load.json

eyas keeps the shipped formats packed (models/quant.py): the model holds the int4 words or fp8 values and their
scales, and its linears and experts unpack on the fly (layers/quant_linear.py; a Triton kernel on CUDA at decode).

One random-weight model with DeepSeek-V3's architecture at Moonlight-16B-A3B's widths (hidden 2048, MLA with
kv_lora 512, 64 experts top-6 of width 1408, 2 shared), cut to 2 layers (1 dense + 1 MoE) and a 32k vocabulary
(~0.8 B parameters), is written as (1) bf16 safetensors, (2) DeepSeek-V3 FP8 (e4m3, 128x128 blocks,
`weight_scale_inv`; every linear in the layers but the router, as DeepSeek ships) and (3) Kimi-K2 INT4
(compressed-tensors pack-quantized, group 32, bf16 scales; the routed experts only, as Kimi ships). Each is
loaded in a fresh subprocess with `load_model(path, "bf16", device)`: file size, load time (median of 3 loads;
page cache warm, the files were just written), peak RSS growth during the first load (VmHWM; on a GPU also the
CUDA peak), bytes of the loaded weights, one eager plain decode step (forward, logits, greedy token), and the
logit differences on a 16-token prompt vs the bf16 original (quantization error) and vs the same checkpoint
dequantized here from the format's definition and saved dense (the loader's own error: ~0 expected), and the
prompt positions whose expert choice changed: FP8 reaches the router's input (layer 0, attention), INT4 on the
experts does not, and with random weights a changed choice moves the logits far more than the weight error does.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.engine.runner import ModelRunner
from eyas.models.loader import load_model
from eyas.models.moe import Router
from eyas.models.quant import pack_int4_groups, quantize_fp8_blocks
from timing import median_ms  # benchmarks/ (the script's own folder is on sys.path)

MODEL = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=32000, hidden_size=2048,
             intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=2, num_attention_heads=16,
             num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
             v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1, n_shared_experts=2,
             first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=2.446, norm_topk_prob=True,
             scoring_func="sigmoid", topk_method="noaux_tc", rms_norm_eps=1e-5, rope_theta=50000.0,
             max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16")
BLOCK, GROUP = [128, 128], 32
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}
INT4_CONFIG = {  # Kimi-K2-Thinking's, trimmed
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": GROUP, "dynamic": False, "actorder": None}}},
    "ignore": ["lm_head"],
}
PROMPT = 16


def shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape, in DeepSeek-V3's HF names (full-rank q, as Moonlight and V2-Lite)."""
    H, heads, E = hf["hidden_size"], hf["num_attention_heads"], hf["n_routed_experts"]
    nope, rope, v, kv = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"], hf["kv_lora_rank"]
    out = {"model.embed_tokens.weight": (hf["vocab_size"], H), "model.norm.weight": (H,),
           "lm_head.weight": (hf["vocab_size"], H)}

    def mlp(prefix, width):
        out.update({f"{prefix}.gate_proj.weight": (width, H), f"{prefix}.up_proj.weight": (width, H),
                    f"{prefix}.down_proj.weight": (H, width)})

    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out.update({f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
                    f"{p}.self_attn.q_proj.weight": (heads * (nope + rope), H),
                    f"{p}.self_attn.kv_a_proj_with_mqa.weight": (kv + rope, H),
                    f"{p}.self_attn.kv_a_layernorm.weight": (kv,),
                    f"{p}.self_attn.kv_b_proj.weight": (heads * (nope + v), kv),
                    f"{p}.self_attn.o_proj.weight": (H, heads * v)})
        if i < hf["first_k_dense_replace"]:
            mlp(f"{p}.mlp", hf["intermediate_size"])
            continue
        out.update({f"{p}.mlp.gate.weight": (E, H), f"{p}.mlp.gate.e_score_correction_bias": (E,)})
        for e in range(E):
            mlp(f"{p}.mlp.experts.{e}", hf["moe_intermediate_size"])
        mlp(f"{p}.mlp.shared_experts", hf["moe_intermediate_size"] * hf["n_shared_experts"])
    return out


def random_weights(hf: dict) -> dict[str, torch.Tensor]:
    """Every matrix N(0, 1/fan_in), router included: unit-scale activations and router logits. (A router drawn
    N(0, 1) at width 2048 saturates DeepSeek's sigmoid scores to exactly 1.0, and ties then flip under any noise.)"""
    g = torch.Generator().manual_seed(0)
    out = {}
    for key, shape in shapes(hf).items():
        if key.endswith("e_score_correction_bias"):
            t = torch.zeros(shape)
        elif len(shape) == 1:
            t = 1 + 0.2 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * shape[1] ** -0.5
        out[key] = t.to(torch.bfloat16)
    return out


# Quantizers: w -> (pieces as shipped, the dequantized weight computed from the format's definition, not the loader).
def fp8(w):
    q, scale_inv = quantize_fp8_blocks(w.float(), BLOCK)
    rows, cols = w.shape
    per_element = torch.kron(scale_inv, torch.ones(*BLOCK))[:rows, :cols]
    return {"weight": q, "weight_scale_inv": scale_inv}, q.float() * per_element


def int4(w):
    pieces = pack_int4_groups(w.float(), GROUP)
    ints = (w.float() / pieces["weight_scale"].repeat_interleave(GROUP, 1)).round().clamp(-8, 7)
    pieces["weight_scale"] = pieces["weight_scale"].to(torch.bfloat16)  # Kimi ships bf16 scales
    return pieces, ints * pieces["weight_scale"].float().repeat_interleave(GROUP, 1)


FORMATS = {  # name -> (quantizer, which weights the shipped checkpoints quantize, quantization_config)
    "fp8": (fp8, lambda k, t: ".layers." in k and t.dim() == 2 and not k.endswith("mlp.gate.weight"), FP8_CONFIG),
    "int4": (int4, lambda k, t: ".mlp.experts." in k, INT4_CONFIG),
}


def write(path: Path, tensors: dict, quantization: dict | None = None) -> None:
    path.mkdir()
    save_file({k: t.contiguous() for k, t in tensors.items()}, path / "model.safetensors")
    config = dict(MODEL, quantization_config=quantization) if quantization else MODEL
    (path / "config.json").write_text(json.dumps(config))


def write_checkpoints(root: Path) -> dict:
    """bf16, then per format the shipped checkpoint and its reference dequantization (dense bf16)."""
    t0 = time.perf_counter()
    weights = random_weights(MODEL)
    write(root / "bf16", weights)
    info = dict(params=sum(t.numel() for t in weights.values()), write_s={"bf16": time.perf_counter() - t0})
    for name, (quantize, selected, qcfg) in FORMATS.items():
        t0 = time.perf_counter()
        shipped, reference, count = {}, {}, 0
        for key, w in weights.items():
            if not selected(key, w):
                shipped[key] = reference[key] = w
                continue
            pieces, deq = quantize(w)
            shipped.update({key[: -len("weight")] + piece: t for piece, t in pieces.items()})
            reference[key] = deq.to(torch.bfloat16)  # what the loader makes of it: fp32 dequantized, cast to bf16
            count += w.numel()
        write(root / name, shipped, qcfg)
        write(root / f"{name}-ref", reference)
        info["write_s"][name] = time.perf_counter() - t0
        info[f"{name}_quantized_params"] = count
        del shipped, reference
    return info


def rss_gb(field: str) -> float:
    """VmRSS / VmHWM of this process. Not getrusage's ru_maxrss: Linux carries that over from the parent across
    fork and exec, so a worker started by a parent holding the weights would report the parent's peak."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024 / 1e9


def measure(path: str, device: str, logits_out: str, repeats: int) -> dict:
    """Loads in this (fresh) process, the first one's peak memory, then a prompt's logits and the decode step."""
    cuda = device == "cuda"
    ids = torch.randint(0, MODEL["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    rss0 = rss_gb("VmRSS")
    if cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(repeats):
        if i:
            del model
            gc.collect()
        t0 = time.perf_counter()
        model = load_model(path, "bf16", device)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if i == 0:
            peak = rss_gb("VmHWM")
            cuda_peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    row = dict(load_s=sorted(times)[len(times) // 2], load_times_s=times, rss_before_load_gb=rss0,
               load_peak_rss_gb=peak, load_rss_growth_gb=peak - rss0, load_cuda_peak_gb=cuda_peak,
               weights_gb=sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
               dtypes=sorted({str(p.dtype) for p in model.parameters()}))
    runner = ModelRunner(model, num_slots=1, max_len=128, device=device)
    routed = []  # each MoE layer's expert choices on the prompt: where they change, logits change by much more
    hooks = [m.register_forward_hook(lambda mod, inp, res: routed.append(res[1].sort(-1).values.cpu()))
             for m in model.modules() if isinstance(m, Router)]
    with torch.no_grad():
        out = runner.forward(ids.to(device), torch.arange(PROMPT, device=device)[None], [0], [0])
        torch.save(dict(logits=model.logits(out.hidden)[0].float().cpu(), experts=torch.stack(routed)), logits_out)
        for h in hooks:
            h.remove()
        last = torch.tensor([[int(ids[0, -1])]], device=device)
        pos = torch.tensor([[PROMPT]], device=device)

        def step():  # the engine's plain decode step: forward, logits, greedy token, one host copy
            h = runner.forward(last, pos, [0], [PROMPT]).hidden
            return model.logits(h[:, -1]).argmax(-1).item()

        row["decode_ms"] = median_ms(step, reps=20, warmup=5, cuda=cuda)  # on the CPU: the mean of 5
    return row


def run_worker(path: Path, device: str, logits_out: Path, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(path), "--device", device, "--logits-out", str(logits_out),
           "--repeats", str(repeats)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict], cuda: bool) -> str:
    mem = ("load GPU peak GB", "load_cuda_peak_gb") if cuda else ("load peak RSS growth GB", "load_rss_growth_gb")
    cols = [("checkpoint", "checkpoint", "{}"), ("quantized params", "quantized_params", "{:,}"),
            ("file GB", "file_gb", "{:.2f}"), ("load s", "load_s", "{:.2f}"), (*mem, "{:.2f}"),
            ("weights GB (loaded)", "weights_gb", "{:.2f}"), ("decode ms", "decode_ms", "{:.1f}"),
            ("max abs dlogit vs bf16", "max_diff_vs_bf16", "{:.3g}"),
            ("rms dlogit vs bf16", "rms_diff_vs_bf16", "{:.3g}"),
            (f"positions rerouted (of {PROMPT})", "positions_rerouted", "{}"),
            ("max abs dlogit vs reference dequant", "max_diff_vs_reference", "{:.3g}")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(k) is None else f.format(r[k]) for _, k, f in cols) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="bench_quant_load.json")
    ap.add_argument("--repeats", type=int, default=3, help="loads per checkpoint (median time; peaks from the first)")
    ap.add_argument("--tmp", default=None, help="where the temporary checkpoints go (default: the system's temp dir)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one load in a fresh process
    ap.add_argument("--logits-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.device, args.logits_out, args.repeats)), flush=True)
        return
    cuda = args.device == "cuda"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="bench_quant_load_") as tmp:
        root = Path(tmp)
        info = write_checkpoints(root)
        print(f"wrote checkpoints: {json.dumps(info['write_s'])}", flush=True)
        rows, logits, experts = [], {}, {}
        for name in ["bf16", *(n for f in FORMATS for n in (f, f"{f}-ref"))]:
            files = (root / name).glob("*.safetensors")
            row = dict(checkpoint=name, file_gb=sum(f.stat().st_size for f in files) / 1e9)
            row.update(run_worker(root / name, args.device, root / f"{name}.logits.pt", args.repeats))
            logits[name], experts[name] = torch.load(root / f"{name}.logits.pt").values()
            rows.append(row)
            print(json.dumps(row), flush=True)
    for r in rows:
        name = r["checkpoint"]
        r["quantized_params"] = info.get(f"{name}_quantized_params")
        diff = logits[name] - logits["bf16"]
        r["max_diff_vs_bf16"], r["rms_diff_vs_bf16"] = diff.abs().max().item(), diff.square().mean().sqrt().item()
        r["positions_rerouted"] = int((experts[name] != experts["bf16"]).any(-1).any(0).sum())
        r["argmax_agrees_with_bf16"] = (logits[name].argmax(-1) == logits["bf16"].argmax(-1)).float().mean().item()
        if name in FORMATS:
            r["max_diff_vs_reference"] = (logits[name] - logits[f"{name}-ref"]).abs().max().item()
    base = logits["bf16"]
    results = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                   date=time.strftime("%Y-%m-%d"), model=MODEL, params=info["params"], write_s=info["write_s"],
                   prompt_tokens=PROMPT, bf16_logits=dict(max_abs=base.abs().max().item(), std=base.std().item()),
                   rows=rows, seconds=time.perf_counter() - t0)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\n{results['device']}, torch {torch.__version__}: DeepSeek-V3 architecture at Moonlight-16B-A3B widths, "
          f"2 layers (1 dense + 1 MoE, 64 experts top-6), vocab 32k, {info['params'] / 1e9:.2f} B params, random "
          f"weights. Quantized checkpoints load kept packed (weights GB), their linears and experts unpacking on "
          f"the fly; the '-ref' rows load dense bf16. Logits over a {PROMPT}-token prompt: bf16 max |x| "
          f"{results['bf16_logits']['max_abs']:.3g}, std {results['bf16_logits']['std']:.3g}. '-ref' rows: the "
          f"quantized checkpoint dequantized here from the format's definition and saved dense. Load s: median of "
          f"{args.repeats} loads from a warm page cache; RSS growth counts the checkpoint's "
          f"mapped pages (about its file size) besides the weights.\n")
    print(table(rows, cuda))
    print(f"\ntotal {results['seconds']:.0f} s; results in {args.out}")


if __name__ == "__main__":
    main()
