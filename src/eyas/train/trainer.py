"""The training loop: TTT loss, AdamW + warmup/cosine, grad clip, checkpoints, resume, metrics, evals.

Usage: Trainer(cfg, draft, source, out_dir, device="cuda", evaluator=AcceptanceEval(...)).fit()

The target is frozen and lives in the source; only the draft's weights train (its embedding is the
target's). An interrupted run started again with the same recipe and output directory continues
from the latest checkpoint and reaches the same weights as an uninterrupted run (on CPU, bit for bit);
SIGTERM or SIGINT stops it between two steps with a checkpoint of the step reached (interrupt.py).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from eyas.errors import EyasError
from eyas.models.eagle3 import Eagle3Draft
from eyas.train.checkpoint import latest_checkpoint, load_state, save_checkpoint, set_rng_state
from eyas.train.distributed import DistInfo, log
from eyas.train.interrupt import StopRequests, TrainingStopped
from eyas.train.recipe import TrainConfig
from eyas.train.ttt import TTTModel


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_groups(draft: Eagle3Draft, weight_decay: float) -> list[dict]:
    """The trainable parameters; with weight decay, the norms' gains and the biases (1-D) in a group of their
    own without it: decay would pull a gain of 1 toward 0. Without weight decay one group, as checkpoints made
    before this split hold it."""
    params = [p for p in draft.parameters() if p.requires_grad]
    if weight_decay == 0:
        return [{"params": params}]
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class Trainer:
    def __init__(self, cfg: TrainConfig, draft: Eagle3Draft, source, out_dir: Path, device="cpu",
                 evaluator=None, eval_every: int = 0, digest: str = "", dist_info: DistInfo | None = None,
                 progress: bool = True):
        self.cfg, self.source, self.out = cfg, source, Path(out_dir)
        self.device = torch.device(device)
        self.dist = dist_info or DistInfo()
        self.evaluator, self.eval_every, self.digest, self.progress = evaluator, eval_every, digest, progress
        self.draft = draft.to(self.device).float().train()
        self.model = TTTModel(self.draft, cfg.ttt_steps, cfg.step_decay)
        self.ddp = (DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda"
                                            else None) if self.dist.world > 1 else self.model)
        self.opt = torch.optim.AdamW(param_groups(self.draft, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay, fused=self.device.type == "cuda")
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
        self.step = 0
        self.history: list[dict] = []

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    # -- checkpoints ------------------------------------------------------------------------------
    def resume(self) -> bool:
        path = latest_checkpoint(self.ckpt_dir)
        if path is None:
            return False
        state = load_state(path)
        if state.get("digest") != self.digest:
            raise EyasError(f"{path} was trained with a different recipe or data; use a new output directory "
                            "(or delete its checkpoints) to start over")
        from safetensors.torch import load_file

        self.draft.load_state_dict(load_file(str(path / "draft.safetensors")))
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.source.stream.load_state(state["data"][self.dist.rank])
        set_rng_state(state["rng"])
        self.step = state["step"]
        if self.metrics_path.is_file():
            # Rows logged after the checkpoint will be logged again: keep the file as of the checkpoint.
            rows = [json.loads(x) for x in self.metrics_path.read_text().splitlines() if x.strip()]
            self.history = [r for r in rows if r["step"] <= self.step]
            if self.dist.main:
                self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        log(self.dist, f"eyas train: resumed from {path} at step {self.step}")
        return True

    def save(self):
        # Every rank's data position goes into the one checkpoint rank 0 writes.
        pos = [None] * self.dist.world
        if self.dist.world > 1:
            dist.all_gather_object(pos, self.source.stream.state())
        else:
            pos[0] = self.source.stream.state()
        if self.dist.main:
            save_checkpoint(self.ckpt_dir, self.step, self.draft,
                            {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                             "data": pos, "digest": self.digest}, keep=self.cfg.keep_checkpoints)
        self.dist.barrier()

    # -- metrics ----------------------------------------------------------------------------------
    def _record(self, row: dict):
        self.history.append(row)
        if self.dist.main:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def _evaluate(self):
        """Rank 0 measures; every rank meets at the barrier, so collectives stay paired."""
        if self.dist.main and self.evaluator is not None:
            t0 = time.perf_counter()
            result = self.evaluator(self.draft)
            self._record({"step": self.step, **result, "eval_s": round(time.perf_counter() - t0, 2)})
            held = result.get("heldout_acc_k")
            log(self.dist, f"eyas train: step {self.step} acceptance length {result['accept_length']:.3f}"
                + (f", held-out accuracy per step {' '.join(f'{a:.3f}' for a in held)}" if held else ""))
        self.dist.barrier()

    # -- the loop ---------------------------------------------------------------------------------
    def train_step(self, batch) -> dict:
        embeds, features, teacher = self.source.prepare(batch)
        amp = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext())
        with amp:
            loss, stats = self.ddp(embeds, features, teacher)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.grad_clip or float("inf"))
        self.opt.step()
        self.sched.step()
        self.step += 1
        return {**stats, "grad_norm": norm.detach()}

    def fit(self, until: int | None = None) -> dict:
        """Train to cfg.steps (or stop early at `until`, as an interruption would); returns a summary."""
        from tqdm import tqdm

        resumed = self.resume()
        if not resumed and self.dist.main:
            self.metrics_path.unlink(missing_ok=True)
        if not resumed and self.eval_every:
            self._evaluate()
        stop = min(until or self.cfg.steps, self.cfg.steps)
        K = self.cfg.ttt_steps
        sums = torch.zeros(3 * K + 1, dtype=torch.float64, device=self.device)
        t0, tokens = time.perf_counter(), 0
        bar = tqdm(total=stop, initial=self.step, desc="fit", unit="step", disable=not (self.progress and self.dist.main))
        with StopRequests() as requests:
            while self.step < stop:
                batch = self.source.stream.next()
                tokens += batch.tokens
                s = self.train_step(batch)
                c = s["count"].double()
                sums += torch.cat([s["loss"].double() * c, s["acc"].double() * c, c, s["grad_norm"].double()[None]])
                bar.update(1)
                if self.step % self.cfg.log_every == 0 or self.step == stop:
                    self._log(sums, tokens, t0, bar)
                    sums.zero_()
                    t0, tokens = time.perf_counter(), 0
                saved = self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps
                if saved:
                    self.save()
                if self._stop_requested(requests):
                    if not saved:
                        self.save()
                    bar.close()
                    raise TrainingStopped(f"training stopped by {requests.signal_name or 'a signal to another rank'} "
                                          f"at step {self.step} of {self.cfg.steps}; checkpoint saved in "
                                          f"{self.ckpt_dir}; run the same command again to resume")
                if self.eval_every and (self.step % self.eval_every == 0 or self.step == self.cfg.steps):
                    self._evaluate()
        bar.close()
        return self.summary()

    def _stop_requested(self, requests: StopRequests) -> bool:
        """Whether any rank got a signal: every rank must stop at the same step, or collectives unpair. With
        several ranks they compare every log_every steps (a step of its own would wait for the GPU)."""
        if self.dist.world == 1:
            return requests.signal_name is not None
        if self.step % self.cfg.log_every:
            return False
        flag = torch.tensor([float(requests.signal_name is not None)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _log(self, sums: torch.Tensor, tokens: int, t0: float, bar):
        if self.dist.world > 1:
            dist.all_reduce(sums)
        K = self.cfg.ttt_steps
        counts = sums[2 * K: 3 * K].clamp(min=1)
        loss_k = (sums[:K] / counts).tolist()
        acc_k = (sums[K: 2 * K] / counts).tolist()
        steps = max(1, self.step % self.cfg.log_every or self.cfg.log_every)
        row = {"step": self.step, "lr": self.sched.get_last_lr()[0],
               "loss": sum(self.cfg.step_decay ** k * l for k, l in enumerate(loss_k)),
               "loss_k": [round(x, 5) for x in loss_k], "acc_k": [round(x, 5) for x in acc_k],
               "grad_norm": float(sums[3 * K]) / self.dist.world / steps,
               "tokens_per_s": round(tokens * self.dist.world / max(1e-9, time.perf_counter() - t0))}
        self._record(row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{acc_k[0]:.3f}")
        if not self.progress:  # no bar: the log line says how the fit goes
            log(self.dist, f"eyas train: [fit] step {self.step}: loss {row['loss']:.3f}, accuracy of step 0 "
                           f"{acc_k[0]:.3f}, {row['tokens_per_s']} tokens/s")

    def summary(self) -> dict:
        train = [r for r in self.history if "loss" in r]
        evals = [r for r in self.history if "accept_length" in r]
        out = {"steps": self.step}
        if self.device.type == "cuda":
            out["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 1)
        if train:
            out.update(final_loss=train[-1]["loss"], final_acc_k=train[-1]["acc_k"])
        if evals:
            out.update(accept_length=evals[-1]["accept_length"], accept_length_history=[
                (r["step"], r["accept_length"]) for r in evals])
        return out
