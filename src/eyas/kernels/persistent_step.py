"""The launch of a persistent decoder step (eyas.kernels.persistent_decode): the target's weights stacked per
kind, the item table and counters of its schedule, the step's buffers, allocated once so that a CUDA graph
can capture the launch. An EAGLE-3 draft's step runs the same kernel as a one-layer decoder (pack_eagle3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from eyas.kernels.persistent_decode import CHUNK, NEW_ROWS, OPS, persistent_step_kernel, split_pow2
from eyas.kernels.persistent_schedule import MAX_ROWS, DecoderShape, Schedule, Tiles, build_schedule


def item_table(schedule: Schedule, device) -> torch.Tensor:
    """[items, 8] int32: op code, layer, part, first column, end column, wait counter, wait count, signal."""
    rows = [(OPS.index(i.op), i.layer, i.part, i.cols[0], i.cols[1], -1 if i.wait is None else i.wait,
             i.wait_count, i.signal) for i in schedule.items]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def expected_counts(schedule: Schedule) -> list[int]:
    """What each counter holds after a complete step: the number of items that signal it."""
    counts = [0] * len(schedule.counters)
    for item in schedule.items:
        counts[item.signal] += 1
    return counts


@dataclass
class PackedDecoder:
    """A Llama-family target's weights stacked per kind across layers, in the target's dtype."""
    shape: DecoderShape
    embed: torch.Tensor        # [V, H]
    attn_norm: torch.Tensor    # [L, H]
    wqkv: torch.Tensor         # [L, (NH + 2 KV) D, H]: query heads, key heads, value heads
    wo: torch.Tensor           # [L, H, NH D]
    mlp_norm: torch.Tensor     # [L, H]
    w_gate_up: torch.Tensor    # [L, 2 I, H]: gate rows, then up rows
    w_down: torch.Tensor       # [L, H, I]
    final_norm: torch.Tensor   # [H]
    lm_head: torch.Tensor      # [V, H]
    cos: torch.Tensor          # [max positions, D], the target's rotary tables
    sin: torch.Tensor
    eps: float
    scale: float
    # An EAGLE-3 draft's midlayer (pack_eagle3): its q/k/v read [input_norm(embedding), hidden_norm(hidden)],
    # wqkv [1, (NH + 2 KV) D, 2 H]; ids are draft ids, d2t [draft vocab] maps them to the target's.
    hidden_norm: torch.Tensor | None = None  # [H]
    d2t: torch.Tensor | None = None

    @property
    def draft(self) -> bool:
        return self.hidden_norm is not None


def shape_error(head_dim: int, hidden: int) -> str | None:
    """Why the kernel cannot take these widths (its attention tiles and LM-head blocks), or None."""
    if head_dim < 16 or head_dim & (head_dim - 1) or hidden < 32:
        return f"head_dim {head_dim} must be a power of two of at least 16, hidden at least 32"
    return None


def unsupported(model) -> str | None:
    """Why the persistent step does not cover an eyas CausalLM (eyas.models.llama), or None: it takes dense
    Llama-family layers without qkv bias or q/k norm, unquantized, on one rank, of widths shape_error takes."""
    cfg = model.config
    if cfg.mla or cfg.moe_layers or cfg.qk_norm or cfg.attention_bias or cfg.quantization or model.tp.size != 1:
        return ("the persistent step covers dense Llama-family layers without qkv bias or q/k norm, unquantized, "
                "on one rank")
    return shape_error(cfg.head_dim, cfg.hidden_size)


def pack_llama(model) -> PackedDecoder:
    """Stack an eyas CausalLM's dense Llama weights; other variants keep today's path (unsupported says why)."""
    reason = unsupported(model)
    if reason:
        raise ValueError(reason)
    cfg = model.config
    layers = model.model.layers
    shape = DecoderShape(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, layers=cfg.num_layers,
                         vocab=cfg.vocab_size)

    def stack(get):
        return torch.stack([get(layer).detach() for layer in layers]).contiguous()

    rotary = model.model.rotary
    return PackedDecoder(
        shape=shape, embed=model.model.embed_tokens.weight.detach(),
        attn_norm=stack(lambda x: x.input_layernorm.weight), wqkv=stack(lambda x: x.self_attn.qkv_proj.weight),
        wo=stack(lambda x: x.self_attn.o_proj.weight), mlp_norm=stack(lambda x: x.post_attention_layernorm.weight),
        w_gate_up=stack(lambda x: x.mlp.gate_up_proj.weight), w_down=stack(lambda x: x.mlp.down_proj.weight),
        final_norm=model.model.norm.weight.detach(), lm_head=model.lm_head.weight.detach(),
        cos=rotary.cos.float().contiguous(), sin=rotary.sin.float().contiguous(), eps=cfg.rms_norm_eps,
        scale=cfg.head_dim ** -0.5)


def draft_unsupported(draft, embedding) -> str | None:
    """Why the persistent step does not cover an EAGLE-3 draft (eyas.models.eagle3) and the target embedding it
    reads, or None: a Llama midlayer whose residual is its raw hidden input and whose output is not normed, with
    fused projections, unquantized, on one rank, of widths shape_error takes."""
    cfg, layer = draft.config, draft.midlayer
    if (cfg.mla or cfg.norm_before_residual or cfg.norm_output or layer.self_attn.qkv_weight is None
            or layer.mlp.gate_up_weight is None or embedding.tp.size != 1):
        return ("the persistent step covers a Llama midlayer with fused projections on one rank, its residual the "
                "raw hidden input and its output not normed")
    return shape_error(cfg.head_dim, cfg.hidden_size)


def pack_eagle3(draft, embedding) -> PackedDecoder:
    """An EAGLE-3 draft's weights as a one-layer PackedDecoder (views: no copy), with the target's embedding."""
    reason = draft_unsupported(draft, embedding)
    if reason:
        raise ValueError(reason)
    cfg, layer = draft.config, draft.midlayer
    attn, mlp = layer.self_attn, layer.mlp
    shape = DecoderShape(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, layers=1,
                         vocab=cfg.draft_vocab_size)
    one = lambda w: w.detach()[None]  # noqa: E731  [1, ...]: the layer stack of one layer
    return PackedDecoder(
        shape=shape, embed=embedding.weight.detach(), attn_norm=one(layer.input_layernorm.weight),
        wqkv=one(attn.qkv_weight), wo=one(attn.o_proj.weight), mlp_norm=one(layer.post_attention_layernorm.weight),
        w_gate_up=one(mlp.gate_up_weight), w_down=one(mlp.down_proj.weight), final_norm=draft.norm.weight.detach(),
        lm_head=draft.lm_head.weight.detach(), cos=draft.rotary.cos.float().contiguous(),
        sin=draft.rotary.sin.float().contiguous(), eps=cfg.rms_norm_eps, scale=attn.scale,
        hidden_norm=layer.hidden_norm.weight.detach(), d2t=draft.d2t)


def kernel_constants(s: DecoderShape, rows: int, tiles: Tiles, captured: int, block_l: int, block_t: int,
                     dtype: torch.dtype, trace: bool, pairs: bool, draft: bool = False) -> dict:
    """The kernel's compile-time constants for this shape, row count and tiling. A 1-row step's polls nap
    between rounds (NAP): 2.5% faster on an H200, while at 4 rows the nap cost 0.5% (docs/kernels.md)."""
    (h1, h2), (q1, q2), (i1, i2) = split_pow2(s.hidden), split_pow2(s.heads * s.head_dim), split_pow2(s.intermediate)
    block = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731
    chunk = lambda k2: min(CHUNK, k2)  # noqa: E731  divides both blocks (powers of two, the second no wider)
    return dict(
        R=rows, BR=triton.next_power_of_2(rows), NH=s.heads, KV=s.kv_heads, D=s.head_dim, NCAP=captured,
        H1=h1, H2=h2, Q1=q1, Q2=q2, I1=i1, I2=i2,
        TQ=tiles.qkv, BQ=block(tiles.qkv), BO=block(tiles.o_proj), BG=block(tiles.gate_up), BD=block(tiles.down),
        HC=chunk(h2), QC=chunk(q2), IC=chunk(i2),
        BL=block_l, BT=block_t, BTILES=block(-(-s.vocab // tiles.lm_head)),
        PAIRS=pairs, PREC="ieee" if dtype == torch.float32 else "tf32", NAP=rows == 1, TRACE=trace, DRAFT=draft)


PAIRS_FROM_ROWS = 4  # bf16 word pairs lost at 1 and 2 rows and won at 4 and 8 (one H100, docs/kernels.md)


def pairs_by_default(shape: DecoderShape, dtype: torch.dtype, rows: int, tiles: Tiles) -> bool:
    """Whether a step of `rows` rows passes the residual stream, attention outputs and activations two bf16
    values to a word (persistent_decode): a bf16 target's steps of PAIRS_FROM_ROWS rows or more, where halving
    the words each boundary polls outweighs the unpacking, on tiles that pairs take."""
    return dtype == torch.bfloat16 and rows >= PAIRS_FROM_ROWS and pair_tiles_error(shape, tiles) is None


def pair_tiles_error(s: DecoderShape, tiles: Tiles) -> str | None:
    """Why word pairs cannot take these tiles, or None: a pair holds a row's columns 2j and 2j + 1, so every
    producer's tile must start and end on an even column: even tiles of an even width."""
    for name, t, width in (("o_proj", tiles.o_proj, s.hidden), ("down", tiles.down, s.hidden),
                           ("gate_up", tiles.gate_up, s.intermediate)):
        if t % 2 or width % 2:
            return f"{name} tiles of {t} over {width} columns: word pairs need even tiles of an even width"
    return None


class PersistentStep:
    """The launch of one persistent step of `rows` rows with its item table, counters and step buffers,
    allocated once so that the launch can be captured in a CUDA graph. pairs: whether its words carry two bf16
    values (default pairs_by_default); an fp32 target may take them too, rounding to bf16 (the CPU tests do)."""

    def __init__(self, packed: PackedDecoder, rows: int, programs: int, tiles: Tiles = Tiles(),
                 block_l: int = 32, block_t: int = 128, num_warps: int = 8,
                 trace: bool = False, capture: tuple[int, ...] = (), pairs: bool | None = None):
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"a persistent step takes 1..{MAX_ROWS} rows, not {rows}")
        s, dev = packed.shape, packed.embed.device
        error = shape_error(s.head_dim, s.hidden)
        if error:
            raise ValueError(error)
        if tiles.attend_splits != 1:
            raise ValueError(f"attend_splits {tiles.attend_splits}: the kernel runs one attention item per query "
                             "head (merging splits costs o_proj a poll per split)")
        pairs = pairs_by_default(s, packed.embed.dtype, rows, tiles) if pairs is None else pairs
        if pairs:
            error = pair_tiles_error(s, tiles)
            if error:
                raise ValueError(error)
        if dev.type == "cuda" and block_t < 16:
            raise ValueError(f"block_t {block_t}: the attention's tl.dot takes at least 16 columns on a GPU")
        if trace and dev.type != "cuda":
            raise ValueError("a traced step reads %globaltimer: it needs a GPU")
        self.packed, self.rows, self.programs, self.tiles, self.pairs = packed, rows, programs, tiles, pairs
        self.schedule = build_schedule(s, tiles)
        self.table = item_table(self.schedule, dev)
        self.expected = torch.tensor(expected_counts(self.schedule), dtype=torch.int32, device=dev)
        self.counters = torch.zeros(len(self.schedule.counters), dtype=torch.int32, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        # What items pass each other: int64 words of an fp32 (or int32) value and the step's epoch
        # (persistent_words.pack), so a reader polls the data itself; the epoch of the last finished step
        # is in self.epoch, so the words never need clearing.
        words = dict(dtype=torch.int64, device=dev)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=dev)
        qw = s.heads * s.head_dim
        self.n_lm_tiles = -(-s.vocab // tiles.lm_head)
        per_word = 2 if pairs else 1
        self.h = torch.zeros(2 * s.layers + 1, rows, s.hidden // per_word, **words)
        self.q = torch.zeros(s.layers, rows, qw, **words)
        # this step's k, v rows, for its own attention
        self.kv_new = torch.zeros(s.layers, 2 * s.kv_heads, NEW_ROWS.value, s.head_dim, **words)
        self.attn = torch.zeros(s.layers, rows, qw // per_word, **words)  # each head's attention output
        self.act = torch.zeros(s.layers, rows, s.intermediate // per_word, **words)
        self.logits = torch.zeros(rows, s.vocab, **f32)
        self.tile_max = torch.zeros(rows, self.n_lm_tiles, **words)
        self.tile_arg = torch.zeros(rows, self.n_lm_tiles, **words)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        # The EAGLE-3 features: feature j is the stream entering layer capture[j] (1..L-1; a layer may repeat).
        # A draft's step writes its one layer's output there instead: the next step's hidden input.
        if packed.draft:
            capture = (s.layers,)
        elif any(not 1 <= i < s.layers for i in capture):
            raise ValueError(f"captured layers {capture} must lie in 1..{s.layers - 1}: the kernel writes each "
                             "from the layer before it")
        self.features = torch.zeros(rows, max(len(capture), 1) * s.hidden, dtype=packed.embed.dtype, device=dev)
        bits = [0] * (s.layers + 1)
        for j, i in enumerate(capture):
            bits[i] |= 1 << j
        self.capture = torch.tensor(bits, dtype=torch.int32, device=dev)
        self.trace = torch.zeros(len(self.schedule.items), 3, dtype=torch.int64, device=dev) if trace else None
        self.meta = dict(kernel_constants(s, rows, tiles, len(capture), block_l, block_t, packed.embed.dtype,
                                          trace, pairs, packed.draft), num_warps=num_warps)

    def __call__(self, ids: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int = 0,
                 positions: torch.Tensor | None = None, row_mask: torch.Tensor | None = None,
                 hidden: torch.Tensor | None = None):
        """Run the step for tokens `ids` [rows] written to cache positions pos..pos+rows-1 of `slot` of eyas's
        KV cache (k_cache, v_cache [L, slots, KV, max_len, D]). positions (default pos + row) feed rotary;
        row_mask [rows, rows] says which new rows each row sees (default causal; a draft tree passes its
        ancestor mask); a draft's step takes its hidden input [rows, H] (its output is self.features).
        Returns (logits, tokens)."""
        R, dev = self.rows, self.tokens.device
        if ids.shape != (R,):
            raise ValueError(f"expected {R} token ids, got shape {tuple(ids.shape)}")
        if pos + R > min(k_cache.shape[3], self.packed.cos.shape[0]) or not 0 <= slot < k_cache.shape[1]:
            raise ValueError(f"positions {pos}..{pos + R - 1} of slot {slot} exceed the cache or rotary table")
        depth = torch.arange(R) if positions is None else positions.cpu() - pos
        row_mask = torch.ones(R, R, dtype=torch.bool).tril() if row_mask is None else row_mask
        where = torch.tensor([pos, slot], device=dev)
        self.launch(ids, where[0:1], where[1:2], depth.to(dev), row_mask.to(dev), k_cache, v_cache, hidden)
        return self.logits, self.tokens

    def launch(self, ids, start, slot, depth, row_mask, k_cache, v_cache, hidden=None) -> None:
        """One step, every input a device tensor that a CUDA graph can capture by address: ids [rows], start
        and slot [1] (the cache positions start..start+rows-1 of that slot), depth [rows] (rotary positions
        start + depth), row_mask [rows, rows] bool (the new rows each row sees); a draft's hidden input
        [rows, H], contiguous, in its dtype."""
        p, s = self.packed, self.packed.shape
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(4) == 1
        assert ids.is_contiguous() and depth.is_contiguous()
        if p.draft != (hidden is not None):
            raise ValueError("a draft's step takes its hidden input, a target's none")
        if hidden is not None and (hidden.shape != (self.rows, s.hidden) or not hidden.is_contiguous()):
            raise ValueError(f"a draft's hidden input must be contiguous [{self.rows}, {s.hidden}], not "
                             f"{tuple(hidden.shape)}")
        self.counters.zero_()
        unused = p.final_norm  # a target's step reads no d2t, hidden input or hidden norm
        persistent_step_kernel[(self.programs,)](
            self.table, len(self.schedule.items), self.counters, self.epoch, ids, start, slot, depth, row_mask,
            row_mask.stride(0), row_mask.stride(1),
            p.embed, unused if p.d2t is None else p.d2t, unused if hidden is None else hidden,
            unused if p.hidden_norm is None else p.hidden_norm,
            p.attn_norm, p.wqkv, p.wo, p.mlp_norm, p.w_gate_up, p.w_down, p.final_norm, p.lm_head,
            p.cos, p.sin, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_cache.stride(3),
            self.h, self.q, self.kv_new, self.attn, self.act, self.logits, self.tile_max,
            self.tile_arg, self.tokens, self.features, self.capture,
            self.trace if self.trace is not None else self.tokens,  # untraced: never written
            p.eps, p.scale, s.layers, s.hidden, s.intermediate, s.vocab, self.n_lm_tiles, **self.meta)

    def stream(self, i: int) -> torch.Tensor:
        """[rows, hidden] fp32: the residual stream entering layer i (i = layers: after the last), as the
        last launch left it."""
        words = self.h[2 * i]
        if not self.pairs:
            return words.view(torch.float32)[..., 0::2]
        # word j holds columns 2j and 2j + 1 (persistent_decode's pairs)
        bits = (words & 0xFFFFFFFF).to(torch.int32)
        lo, hi = (bits << 16).view(torch.float32), (bits & -65536).view(torch.float32)
        return torch.stack([lo, hi], dim=-1).flatten(-2)

    def counters_complete(self) -> bool:
        """Whether every counter ended at the number of items that signal it (a finished step)."""
        return bool(torch.equal(self.counters, self.expected))

    def short_counters(self, counts: torch.Tensor) -> list[str]:
        """The counters of `counts` (a copy of self.counters) below the number of items that signal them, as
        'name got of expected': where an unfinished launch stopped, stage by stage and layer by layer. It reads
        nothing on the device (reading self.expected would wait for the launch, which a hung one never ends)."""
        got, want = counts.tolist(), expected_counts(self.schedule)
        return [f"{name} {g} of {w}" for name, g, w in zip(self.schedule.counters, got, want) if g < w]
