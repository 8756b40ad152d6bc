"""`eyas runs replay ID`: start a recorded launch again exactly as recorded, bench it the same way, compare.

Usage: eyas runs replay 12 --threshold 0.1      (exit 1 when a result got worse by more than 10%)

Exactly as recorded means the recorded argv (or shell line), the config's environment, the same host (over the same
ssh options for a remote run) and the same bench. The new run is recorded with config.launch.replay_of = ID.
It passes when its environment reached every process and no gated result got worse by more than the threshold:
throughput and acceptance must not drop, mean latencies must not rise, errors must not grow. Percentiles are
shown but not gated: at a handful of prompts they are mostly noise.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.errors import EyasError
from eyas.launch.launch import Outcome, Plan, launch, log
from eyas.launch.launch_backends import build_command
from eyas.launch.launch_config import LaunchConfig
from eyas.ledger.ledger import Ledger
from eyas.ledger.record import RunRecord
from eyas.launch.remote import host_from_config
from eyas.table import format_table

HIGHER_IS_BETTER = ("output_tok_s", "request_s", "accept_length", "completed")
LOWER_IS_BETTER = ("errors", "ttft_ms_mean", "itl_ms_mean", "tpot_ms_mean", "e2e_ms_mean")
_BOOKKEEPING = ("server_pid", "processes")


@dataclass
class Change:
    metric: str
    before: float
    after: float | None
    verdict: str  # "ok", "WORSE", or "info" for metrics that are not gated

    @property
    def relative(self) -> float | None:
        if self.after is None or not self.before:
            return None
        return (self.after - self.before) / abs(self.before)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def compare(before: dict, after: dict, threshold: float) -> list[Change]:
    changes = []
    for metric in sorted(k for k, v in before.items() if _number(v) and k not in _BOOKKEEPING):
        b, a = before[metric], after.get(metric)
        a = a if _number(a) else None
        if metric in HIGHER_IS_BETTER:
            worse = a is None or a < b - threshold * abs(b)
        elif metric == "errors":
            worse = a is None or a > b
        elif metric in LOWER_IS_BETTER:
            worse = a is None or a > b + threshold * abs(b)
        else:
            changes.append(Change(metric, b, a, "info"))
            continue
        changes.append(Change(metric, b, a, "WORSE" if worse else "ok"))
    return changes


def render(changes: list[Change]) -> str:
    rows = [[c.metric, f"{c.before:.4g}", "-" if c.after is None else f"{c.after:.4g}",
             "-" if c.relative is None else f"{c.relative:+.1%}", c.verdict] for c in changes]
    return format_table(["metric", "original", "replay", "change", "verdict"], rows)


def plan_from_record(run: RunRecord) -> tuple[Plan, object]:
    if run.kind not in ("launch", "tune") or "launch" not in run.config:
        raise EyasError(f"run {run.run_id} is a {run.kind} run; only runs started by `eyas launch` or `eyas tune` "
                        f"hold the launch config a replay needs")
    launch_cfg = run.config["launch"]
    config = LaunchConfig.from_dict({k: v for k, v in run.config.items() if k != "launch"},
                                    f"record of run {run.run_id}")
    host = host_from_config(launch_cfg)
    python = launch_cfg.get("python") or host.default_python()
    if config.shell_line is None and build_command(config, python) != run.argv:
        log("eyas: note: this eyas builds a different command from the recorded launch config; replaying the "
            "recorded one")
    env = {} if config.shell_line is not None else dict(config.env)
    return Plan(config, list(run.argv), env, dict(config.env), python, "launch", {"replay_of": run.run_id}), host


def replay(ledger: Ledger, run_id: str, threshold: float, keep_running: bool = False,
           launched_by: list[str] | None = None) -> tuple[Outcome, list[Change], bool]:
    if not threshold >= 0:  # NaN too: every comparison with it is false, so nothing could fail
        raise EyasError(f"--threshold must be >= 0, got {threshold}")
    original = ledger.get(run_id)
    plan, host = plan_from_record(original)
    outcome = launch(plan, host, ledger, keep_running=keep_running, launched_by=launched_by)
    changes = compare(original.results, outcome.results, threshold)
    passed = outcome.ok and not any(c.verdict == "WORSE" for c in changes)
    return outcome, changes, passed


def weight_changes(original: RunRecord, again: RunRecord) -> list[str]:
    """The model or draft whose contents changed since the original run: the replay then measured other weights."""
    out = []
    for name in ("model", "draft"):
        before, after = getattr(original, f"{name}_fingerprint"), getattr(again, f"{name}_fingerprint")
        if before and after and before != after:
            out.append(f"the {name} at {getattr(again, name)} changed since run {original.run_id} (fingerprint "
                       f"{before[:12]} -> {after[:12]}): the replay ran other weights")
    return out


def replay_command(ledger: Ledger, args) -> int:
    original = ledger.get(args.id)
    outcome, changes, passed = replay(ledger, original.run_id, args.threshold, args.keep_running, args.argv)
    print(f"replay of {original.run_id} ({original.status}) recorded as {outcome.run_id}")
    for line in weight_changes(original, ledger.get(outcome.run_id)):
        print(f"note: {line}")
    if changes:
        print(render(changes))
    else:
        print("the original run has no numeric results to compare (it had no bench)")
    why = ""
    if not outcome.ok:
        why = " (the replay itself failed: " + ("environment not verified" if not outcome.results.get("env_verified")
                                                else "no bench request completed") + ")"
    print(f"{'PASS' if passed else 'FAIL'} at threshold {args.threshold:g}{why}")
    return 0 if passed else 1
