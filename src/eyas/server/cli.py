"""`eyas serve`: an OpenAI-compatible server over tensor-parallel engine workers.

Usage: eyas serve --model demo --port 8000
       eyas serve --model PATH --draft DRAFT --tp 2 --env NCCL_PROTO=LL --env NCCL_ALGO=Ring

This process never loads the model. It spawns --tp worker processes (one even at --tp 1) with an explicit
environment, prints what environment each one reports, refuses to start if an --env value did not arrive,
then serves HTTP until SIGTERM/SIGINT (drain running requests, exit 0) or until a worker dies (exit 1).
Each serve is a run in the ledger (kind "serve": its configuration, each worker's environment, versions, and a
summary of what it served when it stops) unless --no-record.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import signal
import socket
import sys

from eyas.config import SpecConfig
from eyas.errors import EyasError
from eyas.server.config import ServeConfig, parse_env_pairs

DRAIN_TIMEOUT_S = 120  # on SIGTERM, how long running requests may take to finish before they are cut


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory, or 'demo' for the embedded SmolLM2")
    p.add_argument("--draft", help="EAGLE-3 draft checkpoint directory (enables speculative decoding)")
    p.add_argument("--spec-steps", type=int, help="draft depth (default 3)")
    p.add_argument("--spec-topk", type=int, help="branching per draft step (default 1: a chain)")
    p.add_argument("--spec-draft-tokens", type=int, help="tree nodes sent to verify, root included")
    p.add_argument("--spec-max-batch", type=int, help="decode without speculation while more sequences than this run "
                                                       "(the draft catches up when speculation resumes below it)")
    p.add_argument("--spec-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="per batch size, speculate only where it measures more tokens/s than plain decoding "
                        "(on by default with --draft; --no-spec-adaptive speculates at every step)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel workers (default 1)")
    p.add_argument("--env", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="set in every worker's environment and verified there at start-up (repeatable)")
    p.add_argument("--env-check", choices=("fail", "warn"), default="fail",
                   help="what a worker missing an --env value does to start-up (default fail)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to serve on (default 8000; 0: any free port)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes and /server_info")
    p.add_argument("--max-running", type=int, default=8, help="requests decoded together: KV cache slots (default 8)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503s (default 64)")
    p.add_argument("--steps-in-flight", default="2", metavar="N",
                   help="steps queued at the workers at once (default 2; 1 lets requests join, and stop strings "
                        "act, one step sooner)")
    p.add_argument("--max-model-len", type=int, help="tokens per sequence (default: the model's, at most 2048)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default fp32 on CPU, bf16 on CUDA")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the workers run (default auto: cuda when available)")
    p.add_argument("--profile", action="store_true", help="time each speculative phase (exported in /metrics)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every forward eagerly on CUDA")
    p.add_argument("--db", help="run ledger file (default: $EYAS_HOME/runs.db)")
    p.add_argument("--no-record", action="store_true", help="do not record this serve in the run ledger")


def config_from_args(args) -> ServeConfig:
    given = {k: v for k, v in dict(steps=args.spec_steps, topk=args.spec_topk, draft_tokens=args.spec_draft_tokens,
                                   max_batch=args.spec_max_batch, adaptive=args.spec_adaptive).items()
             if v is not None}  # the others: SpecConfig's defaults (adaptive among them)
    spec = SpecConfig(**given) if args.draft or given else None
    return ServeConfig(model=args.model, draft=args.draft, spec=spec, tp=args.tp, env=parse_env_pairs(args.env),
                       env_check=args.env_check, host=args.host, port=args.port, api_key=args.api_key,
                       max_running=args.max_running, max_queue=args.max_queue, max_model_len=args.max_model_len,
                       dtype=args.dtype, device=args.device, profile=args.profile,
                       cuda_graphs=not args.no_cuda_graphs, steps_in_flight=_positive_int(args.steps_in_flight))


def _positive_int(text: str) -> int | str:
    """text as an int where it is one, else as given, for ServeConfig to refuse in its own words."""
    return int(text) if text.isdigit() else text


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def versions(reports) -> dict:
    import fastapi
    import transformers

    import eyas

    return {"eyas": getattr(eyas, "__version__", "unknown"), "python": platform.python_version(),
            "torch": reports[0].torch if reports else None, "nccl": reports[0].nccl if reports else None,
            "transformers": transformers.__version__, "fastapi": fastapi.__version__}


def run(args) -> int:
    from eyas.config import ModelConfig
    from eyas.dist.launch import STOP_GRACE_S, WorkerGroup
    from eyas.models.demo import resolve_model_path
    from eyas.models.tokenizer import load_tokenizer

    config = config_from_args(args)
    # The front end owns text. A bad checkpoint is reported as such (not as a tokenizer problem) before any
    # worker starts; the tokenizer loads while the workers import and load (seconds each, on a CPU the most
    # of a small server's start), and a bad one stops them before they report.
    path = resolve_model_path(config.model)
    ModelConfig.from_dir(path)
    # The port is taken now, before any worker starts: a port in use fails at once, and nothing the workers
    # open meanwhile (their rendezvous' connections take ephemeral ports) can take it before uvicorn serves.
    listener = listen(config.host, config.port)
    config.port = listener.getsockname()[1]  # --port 0: the port the system chose
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as load_tokenizer sets it, and before the workers inherit
    recorder = _recorder(args, config)
    group = WorkerGroup(config.worker_config(), tp=config.tp, env=config.env, env_check=config.env_check, log=log)
    try:
        group.spawn()
        tokenizer = load_tokenizer(path)
    except BaseException as e:
        group.stop(grace=0)
        listener.close()
        recorder.finish(_status_of(e), {"error": str(e)[:500]})
        raise
    log(f"eyas: starting {config.tp} worker(s) for {config.model}")
    fatal: list[str] = []
    scheduler = server = None
    status, results = "failed", {}
    try:
        info = group.wait_ready()
        recorder.workers([r.to_dict() for r in group.reports])
        recorder.execution_plan(info.execution_plan)
        server, scheduler = _prepare(config, group, info, tokenizer, fatal)
        scheduler.start()
        server.run(sockets=[listener])
        status = "failed" if fatal or not server.started else "ok"
        results = {"stopped": fatal[0] if fatal else "signal" if server.started else "did not start"}
    except BaseException as e:
        status, results = _status_of(e), {"error": str(e)[:500]}
        raise
    finally:
        if scheduler is not None:
            scheduler.stop()
        group.stop(grace=0 if fatal else STOP_GRACE_S)
        listener.close()
        recorder.finish(status, {**results, **(_served(scheduler.metrics) if scheduler is not None else {})})
    if fatal:
        return 1
    if not server.started:  # uvicorn logged why
        return 1
    log("eyas: stopped")
    return 0


def _recorder(args, config):
    from eyas.ledger.serve_record import ServeRecorder

    if args.no_record:
        return ServeRecorder(None, None, log)
    return ServeRecorder.open(args.db, getattr(args, "argv", sys.argv), config.public(), config.model, config.draft,
                              dict(os.environ), config.env, lambda m: log(f"eyas: warning: {m}"))


def _status_of(e: BaseException) -> str:
    return "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"


def _served(metrics) -> dict:
    """What the server did, from its Prometheus counters: requests by outcome, prompt and generated tokens."""
    out = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "eyas_requests_total":
                out[f"requests_{sample.labels.get('outcome', '')}"] = int(sample.value)
            elif sample.name in ("eyas_prompt_tokens_total", "eyas_generation_tokens_total"):
                out[sample.name.removeprefix("eyas_").removesuffix("_total")] = int(sample.value)
    return out


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) for uvicorn to serve on, as uvicorn binds one (SO_REUSEADDR, so a
    restart does not wait out TIME_WAIT); a host that does not resolve or a port in use is an EyasError."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError, OverflowError) as e:
        raise EyasError(f"cannot listen on {host}:{port}: {e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        reason = "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise EyasError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def _prepare(config, group, info, tokenizer, fatal: list[str]):
    """The HTTP server and the scheduler around a started worker group; `fatal` collects a dead worker's message."""
    import uvicorn

    from eyas.dist import env_report
    from eyas.server.app import ServerState, build_app
    from eyas.server.metrics import Metrics
    from eyas.server.scheduler import Scheduler

    log(f"eyas: worker environment ({len(group.reports)} workers; * = requested with --env)\n"
        + env_report.table(group.reports, list(config.env)))
    metrics = Metrics()
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:  # scheduler thread: a worker died
        fatal.append(message)
        log(f"eyas: error: {message}; shutting down")
        if server is not None:
            server.should_exit = True
            server.force_exit = True

    scheduler = Scheduler(group, config.max_running, config.max_queue, metrics, on_fatal, config.steps_in_flight)
    state = ServerState(config=config, info=info, tokenizer=tokenizer, scheduler=scheduler, metrics=metrics,
                        reports=group.reports, env_problems=group.env_problems, versions=versions(group.reports),
                        draining=lambda: server is not None and server.should_exit)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host=config.host, port=config.port, log_level="info",
                                           access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=DRAIN_TIMEOUT_S))
    # uvicorn handles SIGTERM/SIGINT while it serves (stop accepting, drain), then re-raises the signal to the
    # handler that was installed before it. Ours asks for the same graceful stop, so the re-raise cannot kill us
    # before the workers stop, and a signal that lands before uvicorn takes over is not lost.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    if config.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        log(f"eyas: warning: listening on {config.host} without --api-key: anyone who can reach it can use it")
    log(f"eyas: serving {config.model} on http://{config.host}:{config.port} (tp={config.tp}, {info.device}, "
        f"{info.dtype}, max_model_len={info.max_len}, max_running={config.max_running}, "
        f"weights {info.weight_bytes / 2 ** 20:.1f} MiB + KV cache {info.kv_cache_bytes / 2 ** 20:.1f} MiB per rank"
        + (f", draft={config.draft} {config.spec}" if config.draft else "") + ")")
    log(f"eyas: execution plan {json.dumps(info.execution_plan, separators=(',', ':'))}")
    return server, scheduler
