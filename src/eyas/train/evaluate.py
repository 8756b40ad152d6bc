"""Acceptance length measured the only way that counts: the real Engine, chain drafting, held-out prompts.

Usage: ev = AcceptanceEval("demo", prompts, device="cuda", dtype="bf16"); ev(draft)["accept_length"]
       plot_metrics(out / "metrics.jsonl", out / "metrics.png")

Acceptance length = generated tokens per target verify pass (SGLang's definition, the prefill token
not counted), summed over all prompts, greedy, SpecConfig(spec_steps, 1). One Engine is built on the
first call and its draft's weights are refreshed in place on later calls (so its CUDA graphs,
which read those very tensors, stay valid).

Each call also scores the replies it just generated in one teacher-forced pass (train/simulate.py):
`heldout_acc_k`, the draft's top-1 accuracy per step on text it never trained on, sits in metrics.jsonl
next to the `acc_k` the trainer logs on its own batches, so the gap between the two is on the record.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from eyas.config import SpecConfig
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams
from eyas.models.eagle3 import Eagle3Draft


class AcceptanceEval:
    def __init__(self, target: str, prompts: list[list[int]], device="cpu", dtype="fp32", max_tokens: int = 128,
                 spec_steps: int = 3, batch: int = 32, stop_ids: tuple[int, ...] = (), ignore_eos: bool = False):
        self.target, self.prompts, self.device, self.dtype = target, prompts, device, dtype
        self.params = SamplingParams(max_tokens=max_tokens, stop_token_ids=() if ignore_eos else tuple(stop_ids),
                                     ignore_eos=ignore_eos)
        self.spec = SpecConfig(spec_steps, 1, adaptive=False)  # acceptance is measured on every step
        self.batch = min(batch, len(prompts))
        self.max_len = max(len(p) for p in prompts) + max_tokens + 2 * spec_steps + 8
        self.engine: Engine | None = None

    @torch.no_grad()
    def __call__(self, draft: Eagle3Draft) -> dict:
        if self.engine is None:
            # A copy: the engine casts its draft to the target's dtype in place.
            mine = copy.deepcopy(draft).requires_grad_(False).eval()
            self.engine = Engine(self.target, dtype=self.dtype, device=self.device, draft=mine, spec=self.spec,
                                 max_batch=self.batch, max_len=self.max_len)
        else:
            self.engine.decoder.draft.load_state_dict(draft.state_dict())
        t0 = time.perf_counter()
        seqs = self.engine.generate(self.prompts, self.params)
        generated = sum(len(s.output_ids) - 1 for s in seqs)
        passes = sum(s.verify_passes for s in seqs)
        seconds = time.perf_counter() - t0
        return {"accept_length": generated / passes if passes else 0.0, "eval_tokens": generated + len(seqs),
                "eval_tok_s": round((generated + len(seqs)) / max(1e-9, seconds), 1),
                "heldout_acc_k": self._accuracy(seqs)}

    def _accuracy(self, seqs) -> list[float]:
        from eyas.train.simulate import draft_predictions, teacher_forced_accuracy

        target, draft, steps = self.engine.target, self.engine.decoder.draft, self.spec.steps
        right, total = [0] * steps, [0] * steps
        for prompt, seq in zip(self.prompts, seqs):
            ids = torch.tensor(prompt + seq.output_ids, device=self.engine.device)
            r, t = teacher_forced_accuracy(draft_predictions(target, draft, ids, steps), ids, len(prompt))
            right = [a + b for a, b in zip(right, r)]
            total = [a + b for a, b in zip(total, t)]
        return [round(a / b, 5) if b else 0.0 for a, b in zip(right, total)]


def plot_metrics(metrics: Path, png: Path) -> Path | None:
    """Loss, per-step accuracy and acceptance length over training, in one PNG (matplotlib Agg)."""
    rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "accept_length" in r]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    if train:
        steps = [r["step"] for r in train]
        axes[0].plot(steps, [r["loss"] for r in train], label="total (weighted)")
        axes[0].plot(steps, [r["loss_k"][0] for r in train], label="step 0", alpha=0.7)
        K = len(train[0]["acc_k"])
        for k in sorted({0, K // 2, K - 1}):
            axes[1].plot(steps, [r["acc_k"][k] for r in train], label=f"TTT step {k}")
    held = [r for r in evals if r.get("heldout_acc_k")]
    if held:
        axes[1].plot([r["step"] for r in held], [r["heldout_acc_k"][0] for r in held], marker="o", linestyle="--",
                     label="step 0, held-out replies")
    if evals:
        axes[2].plot([r["step"] for r in evals], [r["accept_length"] for r in evals], marker="o")
    for ax, title in zip(axes, ("loss", "accuracy (draft top-1 = target top-1)", "acceptance length (Engine)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
