"""Compile the decode path's kernels for sm_90 with PDL on or off, without a GPU; print what the PTX holds.

Usage: TRITON_INTERPRET=0 python tests/kernels/pdl_ptx.py on|off   -> one JSON object per line

Run in a subprocess by test_pdl.py: the tests' own process runs Triton's interpreter, whose kernels do not
compile. For each kernel: the number of griddepcontrol.launch_dependents and griddepcontrol.wait
instructions, the number of global loads before the wait, and whether the signal comes after the wait.
"""

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from eyas.kernels import (activation, chain_accept, draft_embed, fused_linear, norm, pdl, qkv_rotary, rotary,
                          kv_compact, slot_attention, tree_accept, tree_frontier, tree_select)

BF16, I32, F32, U8 = "*bf16", "i32", "fp32", "*u8"

# name -> (kernel, pointer types by name, constexprs); other runtime arguments are i32 but those in FLOATS
KERNELS = {
    "norm_linear": (fused_linear._norm_linear_kernel, {}, dict(HAS_NORM=True, HAS_DELTA=True, HAS_BIAS=False,
                                                               BLOCK_M=2, BLOCK_N=8, BLOCK_K=1024, CHUNK_K=0)),
    "norm_linear_chunked": (fused_linear._norm_linear_kernel, {}, dict(HAS_NORM=True, HAS_DELTA=True,
                                                                       HAS_BIAS=False, BLOCK_M=4, BLOCK_N=16,
                                                                       BLOCK_K=1024, CHUNK_K=128)),
    "silu_mul_linear": (fused_linear._silu_mul_linear_kernel, {}, dict(BLOCK_M=2, BLOCK_N=8, BLOCK_K=2048,
                                                                       CHUNK_K=0, HAS_RESIDUAL=False)),
    "silu_mul_linear_chunked": (fused_linear._silu_mul_linear_kernel, {}, dict(BLOCK_M=4, BLOCK_N=16,
                                                                               BLOCK_K=2048, CHUNK_K=128,
                                                                               HAS_RESIDUAL=True)),
    "norm_qkv_rotary": (qkv_rotary._norm_qkv_rotary_kernel, {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64",
                                                              "slots": "*i64", "write_pos": "*i64"},
                        dict(HAS_DELTA=True, HAS_BIAS=False, BLOCK_M=4, BLOCK_H=4, BLOCK_K=1024)),
    "silu_mul": (activation._silu_mul_kernel, {}, dict(BLOCK=1024)),
    "rms_norm": (norm._rms_norm_kernel, {"rstd_ptr": "*fp32"}, dict(BLOCK=1024, SAVE_RSTD=False)),
    "add_rms_norm": (norm._add_rms_norm_kernel, {}, dict(BLOCK=1024)),
    "rms_norm_pair": (norm._rms_norm_pair_kernel, {}, dict(BLOCK=1024)),
    "draft_embed": (draft_embed._draft_embed_kernel, {"ids_ptr": "*i64", "d2t_ptr": "*i64"}, dict(BLOCK=1024)),
    "chain_accept": (chain_accept._chain_accept_kernel, {"tokens_ptr": "*i64", "argmax_ptr": "*i64", "sel_ptr": "*i64",
                                                         "accepted_ptr": "*i64", "new_ptr": "*i64"}, dict(BLOCK=8)),
    "tree_accept": (tree_accept._tree_accept_kernel, {"tokens_ptr": "*i64", "parents_ptr": "*i64", "depth_ptr": "*i64",
                                                      "mask_ptr": U8, "argmax_ptr": "*i64", "sel_ptr": "*i64",
                                                      "accepted_ptr": "*i64", "new_ptr": "*i64"},
                    dict(BLOCK_N=8, BLOCK_L=8)),
    "kv_compact": (kv_compact._kv_compact_kernel, {"k_ptr": BF16, "v_ptr": BF16, "slots_ptr": "*i64", "starts_ptr": "*i64",
                                                   "sel_ptr": "*i64", "accepted_ptr": "*i64"},
                   dict(BLOCK_L=8, BLOCK_D=64, HAS_V=True)),
    "tree_select": (tree_select._tree_select_kernel, {"root_ptr": "*i64", "tok_ptr": "*i64", "scores_ptr": "*fp32",
                                                      "par_ptr": "*i64", "depth_ptr": "*i64", "out_tok": "*i64",
                                                      "out_par": "*i64", "out_depth": "*i64", "out_mask": U8},
                    dict(BLOCK_P=128, BLOCK_N=8, CHUNK_P=32)),
    "tree_frontier": (tree_frontier._tree_frontier_kernel,
                      {"scores_ptr": "*fp32", "cs_ptr": "*fp32", "cid_ptr": "*i64", "fr_ptr": "*i64", "out_ptr": BF16,
                       "mask_ptr": U8, "pool_tok": "*i64", "pool_sc": "*fp32", "pool_par": "*i64",
                       "next_scores": "*fp32", "next_ids": "*i64", "next_hidden": BF16, "next_fr": "*i64",
                       "next_mask": U8}, dict(BLOCK_KK=16, BLOCK_K=4, BLOCK_W=8, BLOCK_H=1024)),
    "rotary": (rotary._rotary_kernel, {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"},
               dict(HALF_BLOCK=32, QH_BLOCK=16, KH_BLOCK=4)),
    "rotary_store": (rotary._rotary_store_kernel, {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                                                   "slots": "*i64", "write_pos": "*i64"}, dict(HALF_BLOCK=32)),
    "store_kv": (slot_attention._store_kv_kernel, {"slots": "*i64", "write_pos": "*i64"},
                 dict(BLOCK_H=4, BLOCK_D=64)),
    "slot_attention": (slot_attention._slot_attention_kernel,
                       {"slots": "*i64", "starts": "*i64", "visible": "*i64", "new_mask": U8, "part_m": "*fp32",
                        "part_l": "*fp32", "part_acc": "*fp32", "counters": "*i32"},
                       dict(SPLITS=4, KV_HEADS=3, G=3, D=64, BLOCK_M=16, BLOCK_N=64, TREE=True, PARTIAL=True,
                            DOT_F32=False, MERGE=False, ROTARY=False, ONE_PASS_COLS=384, SPLIT_COLS=128)),
    "slot_attention_rotary": (slot_attention._slot_attention_kernel,
                              {"slots": "*i64", "starts": "*i64", "visible": "*i64", "new_mask": U8,
                               "part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32", "counters": "*i32",
                               "cos": "*fp32", "sin": "*fp32", "pos": "*i64", "wpos": "*i64"},
                              dict(SPLITS=4, KV_HEADS=3, G=3, D=64, BLOCK_M=16, BLOCK_N=64, TREE=False, PARTIAL=True,
                                   DOT_F32=False, MERGE=True, ROTARY=True, ONE_PASS_COLS=384, SPLIT_COLS=128)),
    "slot_attention_merging": (slot_attention._slot_attention_kernel,
                               {"slots": "*i64", "starts": "*i64", "visible": "*i64", "new_mask": U8,
                                "part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32", "counters": "*i32"},
                               dict(SPLITS=4, KV_HEADS=3, G=3, D=64, BLOCK_M=16, BLOCK_N=64, TREE=True, PARTIAL=True,
                                    DOT_F32=False, MERGE=True, ROTARY=False, ONE_PASS_COLS=384, SPLIT_COLS=128)),
    "combine_splits": (slot_attention._combine_splits_kernel,
                       {"part_m": "*fp32", "part_l": "*fp32", "part_acc": "*fp32"},
                       dict(SPLITS=4, KV_HEADS=3, G=3, D=64, BLOCK_M=16)),
}
FLOATS = {"eps", "qk_scale"}
POINTER_NAMES = {"k_cache", "v_cache", "slots", "write_pos", "k", "v", "q", "starts", "visible", "new_mask", "out",
                 "part_m", "part_l", "part_acc", "k_new", "v_new"}


def signature(kernel, pointers: dict, constexprs: dict) -> dict:
    sig = {}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in pointers:
            sig[p.name] = pointers[p.name]
        elif p.name.endswith("_ptr") or p.name in POINTER_NAMES:
            sig[p.name] = BF16
        else:
            sig[p.name] = F32 if p.name in FLOATS else I32
    return sig


def inspect(name: str, mode: str) -> dict:
    kernel, pointers, constexprs = KERNELS[name]
    constexprs = dict(constexprs, USE_PDL={"off": pdl.OFF, "on": pdl.ON}[mode])
    src = ASTSource(kernel, signature(kernel, pointers, constexprs), constexprs=constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": mode != "off"}).asm["ptx"]
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), len(lines))
    signal = next((i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line), len(lines))
    return {"kernel": name, "mode": mode, "signal_after_wait": signal > wait,
            "launch_dependents": sum("griddepcontrol.launch_dependents" in line for line in lines),
            "wait": sum("griddepcontrol.wait" in line for line in lines),
            "loads_before_wait": sum("ld.global" in line for line in lines[:wait]),
            "loads": sum("ld.global" in line for line in lines),
            # the in-kernel split merge: a barrier, the counter's atomic, the partials read from L2
            "bar_sync": sum(line.startswith(("bar.sync", "barrier.sync")) for line in lines),
            "atomics": [word for line in lines for word in line.split() if word.startswith("atom.")],
            "cg_loads": sum("ld.global.cg" in line for line in lines)}


if __name__ == "__main__":
    for kernel_name in sys.argv[2:] or KERNELS:
        print(json.dumps(inspect(kernel_name, sys.argv[1])), flush=True)
