"""`eyas bench`: benchmark an OpenAI-compatible endpoint (eyas, SGLang, vLLM) and print one table or one JSON object.

Usage: eyas bench --url http://127.0.0.1:8000 --dataset mt-bench --num-prompts 80 --concurrency 1 --max-tokens 256

Every run is recorded in the run ledger (kind "bench", $EYAS_HOME/runs.db) unless --no-record, so every number can
be traced back to its settings, and with it what the server is (eyas.launch.server_identity): what it says about
itself, and, when its port is on this machine or on --host USER@HOST, the process tree listening there with each
process's command line and environment. Recording is best effort and never fails the benchmark. The verb lives here, not
in eyas.bench, so that the load generator stays below the ledger and the launcher (eyas.ledger records it, eyas.launch
starts what it measures).
"""

import json
import sys

from eyas.bench.client import run_benchmark
from eyas.bench.config import ENDPOINTS, BenchConfig
from eyas.bench.report import ledger_results

__all__ = ["add_arguments", "run"]


def add_arguments(parser):
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to request (default: the first id at /v1/models)")
    parser.add_argument("--dataset", default="mt-bench", help="mt-bench, humaneval, or PATH.jsonl")
    parser.add_argument("--num-prompts", type=int, help="how many prompts (default: the whole dataset)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="closed loop: requests in flight (default 1)")
    load.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="prompt sampling, arrival times, and the request seed")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent first and left out of the results")
    parser.add_argument("--api-key", help="sent as a bearer token")
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default="chat")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--no-record", action="store_true", help="do not record this run in the ledger")
    parser.add_argument("--db", help="ledger file (default: $EYAS_HOME/runs.db)")
    parser.add_argument("--host", metavar="[USER@]HOST",
                        help="the server runs there: read the processes behind its port over ssh")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="OPT",
                        help="with --host: passed to ssh as -o OPT (repeatable)")


def _warn(msg: str) -> None:
    print(f"eyas: warning: {msg}", file=sys.stderr)


class _Recorder:
    """begin/finish around the benchmark; any ledger problem becomes a warning and recording stops."""

    def __init__(self, args, config: BenchConfig):
        self.ledger = self.run_id = None
        if args.no_record:
            return
        try:
            from eyas.ledger.capture import begin_run
            from eyas.ledger.ledger import Ledger

            server = _identify(args)
            self.ledger = Ledger(args.db)
            self.run_id = begin_run(self.ledger, "bench", getattr(args, "argv", sys.argv),
                                    {**config.to_dict(), "server": server.config} if server else config.to_dict(),
                                    model=args.model or (server.model if server else None))
            for p in server.processes if server else []:
                info = {"pid": p["pid"], "cmdline": p["cmdline"], "host": server.host, "env_source": p["env_source"]}
                self.ledger.add_worker_env(self.run_id, f"pid{p['pid']}", p["env"], info)
        except Exception as e:  # a locked or unwritable ledger must not cost the measurement
            _warn(f"not recorded in the run ledger: {e}")
            self.close()

    def finish(self, status: str, results: dict) -> None:
        if self.run_id is None:
            return
        try:
            self.ledger.finish_run(self.run_id, status, results)
            if status == "ok":  # a failure stays the one line the CLI prints for it
                print(f"eyas: recorded as run {self.run_id}", file=sys.stderr)
        except Exception as e:
            _warn(f"run {self.run_id} could not be finished in the ledger: {e}")
        self.close()

    def close(self) -> None:
        if self.ledger is not None:
            try:
                self.ledger.close()
            except Exception:
                pass
        self.ledger = self.run_id = None


def _identify(args):
    """The server's facts for the record, or None (with a warning) when they cannot be had."""
    from eyas.errors import EyasError
    from eyas.launch.server_identity import identify

    host = None
    try:
        if args.host:
            from eyas.launch.remote import SshHost

            host = SshHost(args.host, args.ssh_option)
        return identify(args.url, args.api_key, host)
    except EyasError as e:
        _warn(f"what the server is was not recorded: {e}")
        return None


def run(args) -> int:
    if args.ssh_option and not args.host:
        from eyas.errors import EyasError

        raise EyasError("--ssh-option needs --host")
    config = BenchConfig(
        url=args.url,
        model=args.model,
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        warmup=args.warmup,
        api_key=args.api_key,
        endpoint=args.endpoint,
    )
    recorder = _Recorder(args, config)
    try:
        result = run_benchmark(config)
    except BaseException as e:
        recorder.finish("interrupted" if isinstance(e, KeyboardInterrupt) else "failed", {"error": str(e)[:500]})
        raise
    recorder.finish("ok" if result.completed else "failed",
                    {**ledger_results(result), "model": result.config.get("model")})
    print(json.dumps(result.to_dict()) if args.json else result.table())
    # A run where nothing succeeded measured nothing; scripts should notice.
    return 0 if result.completed else 1
