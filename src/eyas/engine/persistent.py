"""Batch-1 target passes as one persistent kernel launch (eyas.kernels.persistent_decode), where the plan asks.

A pass of one sequence over T new tokens (a plain decode step, T = 1, or a verify of a chain or tree of up
to eight) runs the whole decoder, the LM head and the argmax as one launch instead of about 240 small
kernels. The engine's graphed bodies (a plain step ahead of the host, a verify pass, a whole speculative
cycle) call `forward` in place of the model and its LM head when `serves` says so: a batch of one row (the
graphs' bucket of one), T up to execution_plan's persistent_rows and a cache of up to MAX_COLUMNS columns.
Other batches, shapes, longer rows, TP > 1 and fp32 targets (unless the plan's persistent_skips_fp32 is off:
the kernel is slower there, see execution_plan) keep today's path.

The target's weights are stacked per kind across layers when the engine is built with the plan asking for
the kernel, and the model's own parameters are then rebound as views of the stacks, so both paths read one
copy of the weights. Not later: a CUDA graph captured before would keep reading the freed tensors. So the
plan in force at build decides whether the engine may use the kernel at all. The kernel writes the
EAGLE-3 features of the draft's capture layers itself.
"""

from __future__ import annotations

import torch

from eyas import execution_plan
from eyas.kernels import switched_on
from eyas.kernels.persistent_schedule import MAX_ROWS, Tiles
from eyas.models.llama import ModelOutput

MAX_COLUMNS = 512  # cache columns up to which a pass runs here (a graph's kv_len: graphs.graph_kv_len). One
# attention item per head reads all of them in turn: the 1-row step beat eyas's at 500 cached tokens and lost at
# 1,000 (docs/kernels.md).
REGISTER_TILE_BYTES = 48 * 1024  # the largest weight tile an item holds in registers (SmolLM2's down tile)


def largest_tile(row_bytes: int, limit: int = 16, budget: int = REGISTER_TILE_BYTES) -> int:
    """The most rows, a power of two up to `limit`, whose weights (row_bytes each) fit `budget` bytes;
    0 where one row does not."""
    t = limit
    while t > 1 and t * row_bytes > budget:
        t //= 2
    return t if t * row_bytes <= budget else 0


def target_tiles(cfg, element_size: int) -> Tiles | None:
    """The target's tiles: the largest (powers of two up to Tiles' 16 rows, a rotation pair within a head) whose
    weights fit what one program holds in registers, so an fp32 target of a 16-bit one's widths holds as many
    bytes in fewer rows. None for widths whose 16-bit, 16-row tiles do not fit: shapes the kernel is not made for
    (each item would stream a thin slice of a wide matrix)."""
    h, qkv = cfg.hidden_size, min(Tiles.qkv, cfg.head_dim // 2)
    row_bytes = dict(qkv=2 * h, o_proj=cfg.num_heads * cfg.head_dim, gate_up=2 * h, down=cfg.intermediate_size)
    limits = dict(qkv=qkv, o_proj=Tiles.o_proj, gate_up=Tiles.gate_up, down=Tiles.down)
    if any(limits[k] * row_bytes[k] * 2 > REGISTER_TILE_BYTES for k in row_bytes):
        return None
    return Tiles(**{k: largest_tile(row_bytes[k] * element_size, limits[k]) for k in row_bytes})


def target_warps(element_size: int) -> int:
    """Warps a program of a target's pass: 4 for 16-bit weights (timed faster at every row count, 1 to 8 rows,
    on an H100: 5-14% at 1 to 5 rows, level to 4% at 8), else 8 (fp32 is untimed at 4)."""
    return 4 if element_size == 2 else 8


def supported_tiles(model) -> Tiles | None:
    """The kernel's tiles for this target (target_tiles), or None where the kernel does not cover it
    (persistent_step.unsupported: dense Llama-family layers on one rank, widths it takes) or no tiles fit.
    Imports Triton: ask only where kernels may run."""
    from eyas.kernels.persistent_step import unsupported

    if unsupported(model):
        return None
    return target_tiles(model.config, next(model.parameters()).element_size())


class PersistentTarget:
    """One launch per batch-1 pass of the runner's target, a PersistentStep per row count, built on demand."""

    def __init__(self, runner):
        self.runner = runner
        self.model = runner.model
        probe = torch.empty(0, device=runner.device)
        self.tiles = supported_tiles(self.model) if switched_on(probe) else None  # CUDA, or the interpreter in tests
        self.element_size = next(self.model.parameters()).element_size()
        self.eligible = self.tiles is not None and (self.element_size == 2
                                                    or not execution_plan.current().persistent_skips_fp32)
        self.packed = None
        self.steps = {}
        dev = runner.device
        self.depth = torch.arange(MAX_ROWS, device=dev)  # a plain pass's rotary offsets: row r at start + r
        self.causal = torch.ones(MAX_ROWS, MAX_ROWS, dtype=torch.bool, device=dev).tril()
        if self.eligible and execution_plan.current().persistent_rows > 0:
            from eyas.kernels.persistent_step import pack_llama  # imports Triton

            self.packed = pack_llama(self.model)
            share_weights(self.model, self.packed)

    def serves(self, rows: int, tokens: int, kv_len: int) -> bool:
        """Whether a pass of `rows` rows (padded to its graph bucket) of `tokens` new tokens, over a cache of
        up to kv_len columns (graphs.graph_kv_len's), runs here."""
        return (self.packed is not None and rows == 1 and kv_len <= MAX_COLUMNS
                and 1 <= tokens <= min(execution_plan.current().persistent_rows, MAX_ROWS))

    def step(self, tokens: int):
        """The PersistentStep of passes of `tokens` rows, built (not compiled) on first use."""
        from eyas.kernels.persistent_step import PersistentStep  # imports Triton

        step = self.steps.get(tokens)
        if step is None:
            dev = self.runner.device
            programs = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
            step = self.steps[tokens] = PersistentStep(self.packed, tokens, programs, self.tiles,
                                                       num_warps=target_warps(self.element_size),
                                                       capture=self._kernel_capture())
        return step

    def forward(self, ids: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, depth: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The target over ids [1, T] written at columns starts[0].. of slots[0] (device tensors; depth [1, T]
        rotary offsets and mask [1, T, T] for a tree, else causal): (argmax [1, T], logits [1, T, vocab] fp32,
        the EAGLE-3 features [1, T, len(capture_layers) * hidden] or None), as the model and its LM head give
        them. The outputs are the step's own buffers: valid until its next launch."""
        T = ids.shape[1]
        step = self.step(T)
        kv = self.runner.kv
        # A drafted tree's tokens and depths may be views; a contiguous one costs no copy.
        depth = self.depth[:T] if depth is None else depth[0].contiguous()
        step.launch(ids[0].contiguous(), starts[:1], slots[:1], depth, self.causal[:T, :T] if mask is None else mask[0],
                    kv.k, kv.v)
        aux, layers = None, self.model.capture_layers
        if layers and self._kernel_capture():
            aux = step.features[None]
        elif layers:  # a target so shallow that the draft reads its embeddings: gathered here
            dtype = step.packed.embed.dtype
            aux = torch.cat([self.model.embed(ids[0]) if i == 0 else step.stream(i).to(dtype) for i in layers],
                            dim=-1)[None]
        return step.tokens[None], step.logits[None], aux

    def _kernel_capture(self) -> tuple[int, ...]:
        """The capture layers the kernel writes the features of: all of them, unless one is the embeddings."""
        layers = self.model.capture_layers
        return () if 0 in layers else tuple(layers)

    def output(self, ids, starts, slots) -> tuple[torch.Tensor, ModelOutput]:
        """A plain step as the engine's decode reads it: (logits [1, vocab], ModelOutput with its features)."""
        _, logits, aux = self.forward(ids, starts, slots)
        return logits[:, -1], ModelOutput(None, aux)


def share_weights(model, packed) -> None:
    """Rebind each layer's parameters as views of the stacked tensors (one copy of the weights)."""
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for param, stack in ((layer.input_layernorm.weight, packed.attn_norm), (attn.qkv_proj.weight, packed.wqkv),
                             (attn.o_proj.weight, packed.wo), (layer.post_attention_layernorm.weight, packed.mlp_norm),
                             (mlp.gate_up_proj.weight, packed.w_gate_up), (mlp.down_proj.weight, packed.w_down)):
            param.data = stack[i]
