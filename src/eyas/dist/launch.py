"""Start the engine workers with an explicit environment, check what they received, and talk to them.

    group = WorkerGroup(WorkerConfig(model="demo"), tp=2, env={"NCCL_PROTO": "LL"})
    info = group.start()            # raises EyasError naming the key and worker if an --env value did not arrive
    group.broadcast(Step()); result = group.receive()

How the environment reaches a worker. A 'spawn' child is exec'd with the parent's C environ (CPython's
spawnv_passfds passes env=None), so the group builds each rank's environment as a dict (the parent's
os.environ, every --env pair, the rendezvous variables) and installs it in the parent's os.environ only for
the instant of Process.start(), restoring it right after. We chose this over setting os.environ inside the
child because the values then exist from exec on: libraries that read variables when they load (OpenMP thread
counts, CUDA, libnccl) see them, and each worker's /proc/PID/environ shows exactly what it was given, which is
what eyas.launch.procenv reads from outside. The swap happens before the server starts any thread.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing as mp
import os
import queue
import socket
import sys
import time

from eyas.dist import env_report
from eyas.dist.env_report import EnvReport
from eyas.dist.messages import EnvReported, ModelInfo, Ready, Shutdown, StepResult, WorkerFailed
from eyas.dist.worker import WorkerConfig, run_worker
from eyas.errors import EyasError

POLL_S = 0.2            # how often a waiting front end checks that every worker is still alive
STOP_GRACE_S = 5.0      # after Shutdown, how long a worker may take before it is terminated


class WorkerDied(EyasError):
    """A worker process exited or reported a failure while the front end needed it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environ_exactly(env: dict[str, str]):
    """Make os.environ (and so the C environ a spawned child inherits) exactly `env`, then restore it.

    Only the differing keys are touched, so a reader of an unrelated variable never sees it vanish."""
    saved = {k: os.environ.get(k) for k in set(env) | set(os.environ) if os.environ.get(k) != env.get(k)}
    for k in saved:
        if k in env:
            os.environ[k] = env[k]
        else:
            del os.environ[k]
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class WorkerGroup:
    def __init__(self, config: WorkerConfig, tp: int = 1, env: dict[str, str] | None = None, env_check: str = "fail",
                 log=None):
        if tp < 1:
            raise EyasError(f"--tp must be >= 1, got {tp}")
        if env_check not in ("fail", "warn"):
            raise EyasError(f"--env-check must be fail or warn, got {env_check!r}")
        self.env = dict(env or {})
        self.config = dataclasses.replace(config, env_keys=tuple(self.env))
        self.size = tp
        self.env_check = env_check
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.ctx = mp.get_context("spawn")
        self.procs: list = []
        self.commands: list = []
        self.results = None
        self.reports: list[EnvReport] = []
        self.env_problems: list[str] = []
        self.info: ModelInfo | None = None

    def child_env(self, rank: int, port: int) -> dict[str, str]:
        env = {**os.environ, **self.env}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(self.size))
        return env

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> ModelInfo:
        """Spawn the workers, check their environments, wait until every engine is built."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the worker processes and return at once: the caller may do its own work while they import
        and load (the server's front end loads the tokenizer meanwhile), then wait_ready()."""
        port = free_port()
        self.results = self.ctx.Queue()
        # Workers ignore SIGTERM, which multiprocessing's own exit hook relies on; this hook (run before it, as
        # atexit is last-in first-out) makes sure no exit path leaves a worker behind or hangs joining one.
        atexit.register(self.stop, 0)
        try:
            for rank in range(self.size):
                q = self.ctx.Queue()
                p = self.ctx.Process(target=run_worker, args=(rank, self.size, self.config, q, self.results),
                                     name=f"eyas-worker-{rank}", daemon=True)
                with environ_exactly(self.child_env(rank, port)):
                    p.start()
                self.procs.append(p)
                self.commands.append(q)
        except BaseException:
            self.stop(grace=0)
            raise

    def wait_ready(self) -> ModelInfo:
        """Check the spawned workers' environments, wait until every engine is built; stops them on failure."""
        try:
            self.reports = [EnvReport.from_dict(m.report) for m in self._gather(EnvReported, "report its environment")]
            self.env_problems = env_report.mismatches(self.reports, self.env)
            if self.env_problems and self.env_check == "fail":
                more = f" (and {len(self.env_problems) - 1} more)" if len(self.env_problems) > 1 else ""
                raise EyasError(self.env_problems[0] + more)
            for problem in self.env_problems:
                self.log(f"eyas: warning: {problem}")
            ready = self._gather(Ready, "load the model")
        except BaseException:
            self.stop(grace=0)  # the workers are not reading commands yet: a Shutdown would only wait
            raise
        self.info = ready[0].info
        return self.info

    def _gather(self, kind, doing: str) -> list:
        """One message of `kind` from every rank, ordered by rank; a failure or death raises at once."""
        got = {}
        while len(got) < self.size:
            msg = self._next(doing)
            if isinstance(msg, WorkerFailed):
                raise self._failure(msg)
            if isinstance(msg, kind):
                got[msg.rank] = msg
        return [got[r] for r in range(self.size)]

    def _next(self, doing: str):
        while True:
            try:
                return self.results.get(timeout=POLL_S)
            except queue.Empty:
                dead = self.dead()
                if dead is not None:
                    raise WorkerDied(f"worker {dead} exited with code {self.procs[dead].exitcode} "
                                     f"before it could {doing}") from None

    def _failure(self, msg: WorkerFailed) -> WorkerDied:
        """Name the root cause: when a rank dies its peers fail inside the next collective, so a dead rank wins."""
        time.sleep(POLL_S)  # let the OS reap a rank that was killed a moment ago
        dead = self.dead()
        if dead is not None and dead != msg.rank:
            return WorkerDied(f"worker {dead} exited with code {self.procs[dead].exitcode} "
                              f"(worker {msg.rank} then failed: {msg.message})")
        return WorkerDied(f"worker {msg.rank} failed: {msg.message}")

    def dead(self) -> int | None:
        """The rank of a worker that is no longer running, if any."""
        for rank, p in enumerate(self.procs):
            if not p.is_alive():
                return rank
        return None

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Ask every worker to finish, give them `grace` seconds, then kill what still lingers.

        Use grace=0 when a rank has died: the others may be blocked in a collective that will never complete."""
        for q, p in zip(self.commands, self.procs):
            if grace > 0 and p.is_alive():  # with no grace it would only start a feeder thread (see below)
                with contextlib.suppress(Exception):
                    q.put(Shutdown())
        deadline = time.monotonic() + grace
        for p in self.procs:
            while p.is_alive() and time.monotonic() < deadline:
                self._drain_results()  # a worker blocked on a full result pipe could not exit otherwise
                p.join(timeout=0.05)
        for p in self.procs:
            if p.is_alive():  # workers ignore SIGTERM (see worker.py), so past the grace period it is SIGKILL
                p.kill()
                p.join(timeout=2.0)
        # A queue's feeder thread holds two of its semaphores and, once told to quit, unlinks them as it drops
        # them. Left running, it races our exit: a semaphore unlinked but never unregistered makes the
        # resource tracker warn of a leak. A worker that exited 0 read Shutdown, the last command, so its
        # feeder has nothing left to write and joins at once; any other may have left it blocked on a full pipe.
        for q, p in zip(self.commands, self.procs):
            q.close()
            if p.exitcode == 0:
                q.join_thread()
            else:
                q.cancel_join_thread()
        if self.results is not None:
            self._drain_results()
            self.results.cancel_join_thread()
        atexit.unregister(self.stop)

    def _drain_results(self) -> None:
        with contextlib.suppress(Exception):
            while True:
                self.results.get_nowait()

    # -- commands and results -------------------------------------------------------------------------
    def broadcast(self, cmd) -> None:
        """Every rank gets every command in the same order: that order is the lockstep."""
        for q in self.commands:
            q.put(cmd)

    def receive(self) -> StepResult:
        """Rank 0's result for the last Step; raises WorkerDied if any worker dies or fails meanwhile."""
        while True:
            msg = self._next("finish the step")
            if isinstance(msg, WorkerFailed):
                raise self._failure(msg)
            if isinstance(msg, StepResult):
                return msg

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]
