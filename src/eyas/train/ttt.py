"""Training-time test (TTT): the draft unrolled K steps over a whole sequence at once, with EAGLE-3's loss.

Usage: loss, stats = TTTModel(draft, steps=7, decay=0.8)(embeds, features, teacher)

Indexing (position p holds token x_p and the target's features f_p and distribution z_p over x_{p+1}):
- step 0, index t: hidden fc(f_t), embedding of x_{t+1}, RoPE position t; predicts z_{t+1}.
- step k, index t: hidden = the draft's own pre-norm output of step k-1 at index t, embedding of
  x_{t+1+k}, RoPE position t+k; predicts z_{t+1+k}. This is what the inference chain computes at
  position t+k after k-1 guesses, with the true tokens in place of the guesses (teacher forcing).
- attention at step k: index t sees the step-0 keys of indices 0..t (the committed prefix, as in the
  draft's KV cache) and, of steps 1..k, only its own index's keys (its own chain of guesses).
The attention math reuses the draft's own modules (its attention's `project` and `output`, for the Llama
and the latent-attention layer alike): the weights we train are exactly the ones inference runs, and
tests/train/test_ttt.py checks the result against the inference KV-cache path step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eyas.kernels import switched_on
from eyas.models.eagle3 import Eagle3Draft
from eyas.train.soft_ce import soft_cross_entropy


@dataclass
class Teacher:
    """What the target says about a batch, computed once and shifted per TTT step."""

    probs: torch.Tensor   # [B, T, Vd] fp32: softmax of z_p restricted to the draft vocabulary
    ids: torch.Tensor     # [B, T] draft id of argmax z_p (0 where it is outside the draft vocabulary)
    valid: torch.Tensor   # [B, T] bool: argmax z_p is in the draft vocabulary and x_{p+1} is the assistant's
    weight: torch.Tensor | None = None  # [B, T] loss weight of position p (that of token x_{p+1}); None: all 1


def teacher_from_logits(logits: torch.Tensor, loss_mask: torch.Tensor, used: torch.Tensor,
                        t2d: torch.Tensor, token_weight: torch.Tensor | None = None,
                        temperature: float = 1.0) -> Teacher:
    """logits [B, T, V] of the target; loss_mask [B, T] marks assistant tokens (padding is False);
    token_weight [B, T] optional loss weights of the tokens (train/repeats.py). A temperature below 1
    sharpens the teacher toward its argmax, the token a greedy verify accepts; the argmax, and so ids and
    valid, do not depend on it."""
    top = logits.argmax(-1)
    in_vocab = t2d[top]
    draft_index = torch.cumsum(t2d.long(), 0) - 1
    ids = torch.where(in_vocab, draft_index[top], torch.zeros_like(top))
    # z_p predicts x_{p+1}: the position is trained when the token it predicts was written by the assistant.
    next_is_assistant = F.pad(loss_mask[:, 1:], (0, 1), value=False)
    z = logits.index_select(-1, used)
    if temperature != 1.0:
        z = z.float() / temperature
    probs = torch.softmax(z, dim=-1, dtype=torch.float32)
    weight = None if token_weight is None else F.pad(token_weight[:, 1:], (0, 1), value=1.0)
    return Teacher(probs, ids, in_vocab & next_is_assistant, weight)


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, scale):
        from eyas.kernels.ttt_attention import ttt_attention_forward

        out, lse = ttt_attention_forward(q, k0, v0, kd, vd, scale)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from eyas.kernels.ttt_attention import ttt_attention_backward

        return (*ttt_attention_backward(*ctx.saved_tensors, grad_out, ctx.scale), None)


def _kernel_fits(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """The Triton path (eyas.kernels.ttt_attention): on CUDA unless EYAS_KERNELS is "0" ("force": any device,
    for the tests), for power-of-two head dims shared by q, k and v (the Llama draft; the latent-attention
    draft's wide shared head keeps the torch path)."""
    k, v = cache[0]
    D = q.shape[-1]
    return (switched_on(q) and 16 <= D <= 128 and not D & (D - 1) and k.shape[-1] == v.shape[-1] == D
            and q.dtype == k.dtype == v.dtype)


def ttt_attention(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """q: [B, T, H, D]; cache: per step (k, v) [B, T, Hkv, D]. Causal over step 0, diagonal over steps 1..k.
    Returns [B, T, H * D]."""
    if _kernel_fits(q, cache):
        B, T, H, D = q.shape
        k0, v0 = cache[0]
        if len(cache) > 1:
            kd = torch.stack([k for k, _ in cache[1:]])
            vd = torch.stack([v for _, v in cache[1:]])
        else:
            kd = vd = k0.new_empty((0, *k0.shape))
        return _TTTAttention.apply(q, k0, v0, kd, vd, scale).view(B, T, H * D)
    return ttt_attention_torch(q, cache, scale)


def ttt_attention_torch(q: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """`ttt_attention` in torch. The query heads sharing a key/value head are stacked along the rows instead
    of copying keys per head: a latent-attention draft shares one (kv_lora_rank + rope)-wide head among all
    of its heads."""
    B, T, H, D = q.shape
    G = cache[0][0].shape[2]
    rep = H // G

    def group(x):  # [B, T, Hkv, D] -> [B, Hkv, 1, T, D]
        return x.transpose(1, 2)[:, :, None]

    # The scale goes on q (B*T*H*D values), not on the scores (B*H*T*T).
    q = (q * scale).view(B, T, G, rep, D).permute(0, 2, 3, 1, 4)        # [B, Hkv, rep, T, D]
    k0, v0 = cache[0][0].transpose(1, 2), cache[0][1].transpose(1, 2)   # [B, Hkv, T, D]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    first = (q.reshape(B, G, rep * T, D) @ k0.transpose(-1, -2)).view(B, G, rep, T, T)
    scores = [first.masked_fill(~causal, float("-inf"))]
    scores += [(q * group(k)).sum(-1, keepdim=True) for k, _ in cache[1:]]
    scores = scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)
    # Softmax in the scores' dtype: torch accumulates in fp32 and rounds once, as the cast that used to follow
    # an fp32 softmax did, without writing and re-reading an fp32 copy (autocast would upcast it).
    with torch.autocast(q.device.type, enabled=False):
        p = torch.softmax(scores, dim=-1).to(v0.dtype)
    out = (p[..., :T].reshape(B, G, rep * T, T) @ v0).view(B, G, rep, T, D)
    for j, (_, v) in enumerate(cache[1:]):
        out = out + p[..., T + j: T + j + 1] * group(v)
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, H * D)


def midlayer_step(draft: Eagle3Draft, embeds, hidden, positions, cache: list) -> torch.Tensor:
    """One TTT step of the draft's decoder layer; appends this step's keys/values to `cache`.
    Mirrors MidLayer.forward with the attention above in place of the KV-cache attention."""
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    normed = layer.hidden_norm(hidden)
    residual = normed if layer.norm_before_residual else hidden
    x = torch.cat([layer.input_layernorm(embeds.to(hidden.dtype)), normed], dim=-1)
    q, k, v = attn.project(x, positions, draft.rotary)
    cache.append((k, v))
    h = residual + attn.output(ttt_attention(q, cache, attn.scale))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded at the end to the same length (padding is never attended by valid indices)."""
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


def unroll(draft: Eagle3Draft, embeds: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """embeds: [B, T, H] embeddings of x_0..x_{T-1}; features: [B, T, 3Ht]. Returns each step's output (Eagle3Draft.step_output)."""
    B, T, _ = embeds.shape
    positions = torch.arange(T, device=embeds.device).expand(B, T)
    hidden = draft.fuse_features(features)
    cache, outs = [], []
    for k in range(steps):
        hidden = draft.step_output(midlayer_step(draft, shift_left(embeds, 1 + k), hidden, positions + k, cache))
        outs.append(hidden)
    return outs


class TTTModel(nn.Module):
    """The draft plus its TTT loss, as one module: DistributedDataParallel syncs gradients of what
    `forward` touches, so the whole unrolled computation must run inside it."""

    def __init__(self, draft: Eagle3Draft, steps: int = 7, decay: float = 0.8):
        super().__init__()
        self.draft, self.steps, self.decay = draft, steps, decay

    def forward(self, embeds, features, teacher: Teacher):
        T = embeds.shape[1]
        total = embeds.new_zeros((), dtype=torch.float32)
        losses, accs, counts = [], [], []
        for k, out in enumerate(unroll(self.draft, embeds, features, self.steps)):
            n = T - 1 - k  # indices whose target position t+1+k exists
            if n <= 0:  # a batch shorter than the unroll: later steps have nothing to predict
                zero = total.new_zeros(())
                losses.append(zero)
                accs.append(zero)
                counts.append(zero.long())
                continue
            logits = self.draft.head_output(out[:, :n])  # soft_cross_entropy reads it in float32 itself
            valid = teacher.valid[:, 1 + k:]
            count = valid.sum()
            denom = count.clamp(min=1).float()
            ce, top = soft_cross_entropy(logits, teacher.probs[:, 1 + k:])
            if teacher.weight is None:
                loss = -(ce * valid).sum() / denom
            else:  # a weighted mean over the valid positions
                w = teacher.weight[:, 1 + k:] * valid
                loss = -(ce * w).sum() / w.sum().clamp(min=1e-6)
            acc = ((top == teacher.ids[:, 1 + k:]) & valid).sum() / denom
            total = total + self.decay ** k * loss
            losses.append(loss.detach())
            accs.append(acc.detach())
            counts.append(count.detach())
        return total, {"loss": torch.stack(losses), "acc": torch.stack(accs), "count": torch.stack(counts)}
