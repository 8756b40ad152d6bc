"""One engine worker: a tensor-parallel rank that applies the front end's commands to its Engine, in order.

Started by eyas.dist.launch.WorkerGroup in a fresh 'spawn' process whose environment was built explicitly
(see launch.py). Every rank runs the same Engine control flow on the same commands, so scheduling,
speculation depth and acceptance are identical everywhere and each collective has its partners. The
EAGLE-3 draft is small, so it is replicated: every rank runs the whole draft on the same inputs rather than
sharding it and paying an all-reduce per draft step.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass

from eyas.config import SpecConfig
from eyas.dist import env_report
from eyas.dist.messages import (Abort, AddRequest, EnvReported, ModelInfo, Ready, RequestUpdate, Shutdown, Step,
                                StepResult, WorkerFailed)
from eyas.errors import EyasError

PARENT_POLL_S = 1.0  # how often an idle worker checks that the front end is still alive
POLICY_EVERY = 32    # steps between snapshots of the adaptive policy's estimates sent to /metrics


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to build its Engine; the same for every rank."""

    model: str
    dtype: str | None = None        # None: fp32 on CPU, bf16 on CUDA
    device: str = "auto"            # auto | cpu | cuda
    draft: str | None = None
    spec: SpecConfig | None = None
    max_running: int = 8            # the Engine's cache slots
    max_model_len: int | None = None
    profile: bool = False
    cuda_graphs: bool = True
    env_keys: tuple[str, ...] = ()  # the --env keys to report on


def resolve_device(device: str, rank: int) -> str:
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if rank >= torch.cuda.device_count():
            raise EyasError(f"worker {rank} needs GPU {rank}, but only {torch.cuda.device_count()} are visible")
        return f"cuda:{rank}"
    if device != "cpu":
        raise EyasError(f"unknown device '{device}'; use cpu, cuda or auto")
    return device


def build_engine(config: WorkerConfig, rank: int, size: int, device: str):
    import torch
    import torch.distributed as dist

    from eyas.config import ModelConfig
    from eyas.tensor_parallel import TPContext
    from eyas.engine.engine import Engine
    from eyas.engine.profile import Profiler
    from eyas.models.demo import resolve_model_path

    cfg = ModelConfig.from_dir(resolve_model_path(config.model))
    max_len = config.max_model_len or min(cfg.max_position_embeddings, 2048)
    if max_len > cfg.max_position_embeddings:
        raise EyasError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings "
                        f"({cfg.max_position_embeddings})")
    tp = TPContext()
    if size > 1:  # a group of one would only add a rendezvous: TPContext skips collectives at size 1
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        # MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE are in the environment launch.py built for this process.
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method="env://",
                                rank=rank, world_size=size)
        tp = TPContext(rank, size, dist.new_group(list(range(size))))
    dtype = config.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    profiler = Profiler(device) if config.profile else None
    engine = Engine(config.model, dtype=dtype, device=device, draft=config.draft, spec=config.spec,
                    max_batch=config.max_running, max_len=max_len, tp=tp, cuda_graphs=config.cuda_graphs,
                    profiler=None)
    engine.warm_up()  # every rank captures the same graphs in the same order (their collectives must pair up)
    engine.profiler = profiler  # the warm-up's steps are not the server's
    return engine, dtype


def cpu_thread_count(cores: int, ranks: int) -> int:
    """Torch threads per rank on a CPU: the ranks split every core. At concurrency 1 the front end (HTTP,
    tokenizer, scheduler) waits while a step runs, so leaving it a core idles that core: served on an idle
    2-core machine (SmolLM2-135M, fp32), 2 threads gave 20.1 tok/s plain and 29.5 with EAGLE-3, 1 thread 15.0
    and 19.3 (OMP_WAIT_POLICY=PASSIVE with 2 threads: 16.8 plain). On a machine other processes keep busy,
    OpenMP threads that spin against them collapse (2.6 tok/s vs 15.0 with 1 thread): OMP_NUM_THREADS, which
    this rule leaves alone, sets the count there."""
    return max(1, cores // max(1, ranks))


def _share_cpu_threads(size: int) -> None:
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(cpu_thread_count(cores, size))


def run_worker(rank: int, size: int, config: WorkerConfig, commands, results) -> None:
    """Process entry point. Reports the environment, builds the engine, then serves commands until Shutdown."""
    # Ctrl-C in a terminal, `timeout`, and systemd signal the whole process group at once. A worker that died of
    # that signal would cut the requests the front end is draining, so workers ignore it: the front end stops them
    # (Shutdown, else SIGKILL), and an orphaned worker notices its parent is gone and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    env_report.apply_test_hook(rank)
    try:
        device = resolve_device(config.device, rank)
        results.put(EnvReported(rank, env_report.collect(rank, device, list(config.env_keys)).to_dict()))
        if device == "cpu":
            _share_cpu_threads(size)
        engine, dtype = build_engine(config, rank, size, device)
    except Exception as e:  # any failure must reach the front end as one line, not as a silent exit
        results.put(WorkerFailed(rank, _one_line(e)))
        raise SystemExit(1)
    results.put(Ready(rank, ModelInfo(max_len=engine.max_len, margin=engine.lookahead,
                                      vocab_size=engine.config.vocab_size, eos_token_ids=sorted(engine.eos_ids),
                                      device=device, dtype=dtype, speculative=engine.decoder is not None,
                                      weight_bytes=engine.weight_bytes(), kv_cache_bytes=engine.kv_cache_bytes(),
                                      execution_plan=engine.execution_plan_summary)))
    try:
        Lockstep(engine, rank, results).serve(commands)
    except Exception as e:
        traceback.print_exc()
        results.put(WorkerFailed(rank, _one_line(e)))
        raise SystemExit(1)
    finally:
        import torch.distributed as dist

        # Not on NCCL: destroy_process_group can hang once collectives were captured in a CUDA graph
        # (pytorch/pytorch#115388); the process is exiting, which frees the communicators anyway.
        if dist.is_initialized() and dist.get_backend() != "nccl":
            dist.destroy_process_group()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    if isinstance(e, EyasError) and text:
        return text[0]
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class Lockstep:
    """Applies commands to the engine; rank 0 turns each step into a StepResult."""

    def __init__(self, engine, rank: int, results):
        self.engine = engine
        self.rank = rank
        self.results = results
        self.seqs = {}       # request id -> Sequence, until finished or aborted
        self.sent = {}       # request id -> output tokens already reported
        self.refused = []    # RequestUpdates for adds the engine refused, sent with the next step
        self.steps = 0

    def serve(self, commands) -> None:
        parent = multiprocessing.parent_process()
        while True:
            try:
                cmd = commands.get(timeout=PARENT_POLL_S)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return  # orphaned: nobody will ever send Shutdown
                continue
            if isinstance(cmd, Shutdown):
                return
            self.apply(cmd)

    def apply(self, cmd) -> None:
        if isinstance(cmd, AddRequest):
            try:
                self.seqs[cmd.id] = self.engine.add(cmd.prompt_ids, cmd.params)
                self.sent[cmd.id] = 0
            except EyasError as e:  # every rank refuses identically, so the lockstep holds
                self.refused.append(RequestUpdate(cmd.id, [], None, 0, error=str(e)))
        elif isinstance(cmd, Abort):
            seq = self.seqs.pop(cmd.id, None)
            self.sent.pop(cmd.id, None)
            if seq is not None and not seq.finished:
                self.engine.abort(seq)
        elif isinstance(cmd, Step):
            self.step()
        else:
            raise TypeError(f"unknown command {type(cmd).__name__}")

    def step(self) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        stepped = eng.has_work()
        if stepped:
            eng.step()
        step_ms = (time.perf_counter() - t0) * 1e3
        updates, self.refused = self.refused, []
        for rid, seq in list(self.seqs.items()):
            n = self.sent[rid]
            if len(seq.output_ids) > n or seq.finished:
                updates.append(RequestUpdate(rid, seq.output_ids[n:], seq.finish_reason, seq.verify_passes,
                                             logprobs=None if seq.logprobs is None else seq.logprobs[n:]))
                self.sent[rid] = len(seq.output_ids)
            if seq.finished:
                del self.seqs[rid], self.sent[rid]
        if self.rank != 0:
            return
        phases = eng.profiler.drain() if eng.profiler is not None else {}
        self.steps += 1
        policy = eng.policy_snapshot() if self.steps % POLICY_EVERY == 0 or not eng.has_work() else None
        self.results.put(StepResult(updates, running=len(eng.running), waiting=len(eng.waiting),
                                    kv_usage=len(eng.running) / eng.usable_slots(), step_ms=step_ms,
                                    joined=eng.last_admitted if stepped else 0, phase_ms=phases,
                                    spec_step=eng.last_decision if stepped else None, spec_policy=policy))
