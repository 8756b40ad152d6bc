"""Train variants ("arms") of a recipe on the same data, one GPU each, and measure their acceptance side by side
with a baseline draft.

Usage: python benchmarks/train_arms.py --config recipes/smollm2-135m-eagle3.toml --out ~/arms \
           --arm temp05:train.teacher_temperature=0.5 --arm wd01:train.weight_decay=0.1 \
           [--baseline assets/smollm2-135m-eagle3] [--devices cuda:0,cuda:1] [--accept-sets 2]

An arm is NAME:SECTION.KEY=VALUE[:SECTION.KEY=VALUE...] (VALUE in TOML syntax, as `eyas train --set` takes it);
`NAME:` alone retrains the recipe as it is. The data stages (synth, regen, vocab) run once, on the first
device, into OUT/data-run, exactly as one `eyas train` on one GPU would make them. Each arm starts from a copy
of that data, so the arms differ in their settings alone; each builds its own vocabulary from it (seconds on
the tokenized samples), as an arm may set draft.draft_vocab_size. Arms are spread over the devices, each
device training its arms one after another; then every draft's acceptance is measured, again one per device
(bench_smollm2.py --sections accept: MT-bench, and HumanEval with --accept-sets 2).

Everything resumes: after an interruption the same command skips what finished (the stages resume
themselves). Stage times go to OUT/times.json, results to OUT/arms.json; logs to OUT/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_STAGES = ("synth", "regen", "vocab")
# What an arm's directory takes from the data run: the data, the vocabulary and the tokenized samples.
SHARED = ("data", "vocab.safetensors", "samples.safetensors")
_times_lock = threading.Lock()


class ArmError(Exception):
    pass


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or name in ("data-run", "logs", "baseline"):
        raise ArmError(f"arm name {name!r}: use letters, digits, '-' and '_' (not data-run, logs or baseline)")
    sets = [s for s in rest.split(":") if s]
    for s in sets:
        if not re.fullmatch(r"[A-Za-z_]+\.[A-Za-z_]+=.+", s):
            raise ArmError(f"arm {name}: {s!r} is not SECTION.KEY=VALUE")
    return name, sets


def record_time(out: Path, key: str, seconds: float):
    with _times_lock:
        path = out / "times.json"
        times = json.loads(path.read_text()) if path.is_file() else {}
        times[key] = round(seconds, 1)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(times, indent=2) + "\n")
        os.replace(tmp, path)


def run(what: str, cmd: list[str], log: Path, env: dict | None = None):
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise ArmError(f"{what} failed (exit {rc}): {tail[0]}; log: {log}")


def on_device(device: str, sharing: int = 1) -> tuple[str, dict]:
    """The --device a child process gets, and its environment: cuda:N runs as the only GPU it sees, and
    each of the `sharing` children running at once gets its share of the host's cores (unless
    OMP_NUM_THREADS is set): two stages each running a thread per core slowed one another ~5x. The
    children import eyas from this checkout's src/, so they run where eyas is not installed (a job
    started without the PYTHONPATH of its parent shell once failed at its first stage)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // sharing)))
    src, paths = str(ROOT / "src"), [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in paths if p != src])
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        return "cuda", env
    return device, env


def train(what: str, stage: str, args, out: Path, device: str, sets: list[str], log: Path):
    dev, env = on_device(device, len(args.devices))
    cmd = [sys.executable, "-m", "eyas.cli", "train", stage, "--config", args.config, "--out", str(out),
           "--device", dev, "--no-progress"]
    for s in args.common + sets:
        cmd += ["--set", s]
    run(what, cmd, log, env)


def check_settings(directory: Path, settings: dict):
    """Write what a directory is made with the first time; later runs must ask for the same, or results
    made with other settings would be reused."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "settings.json"
    if not path.is_file():
        path.write_text(json.dumps(settings, indent=2) + "\n")
    elif json.loads(path.read_text()) != settings:
        raise ArmError(f"{directory} was made with other settings ({path}); use another --out or remove it")


def make_data(args, out: Path):
    run_dir = out / "data-run"
    check_settings(run_dir, {"config": args.config_text, "set": args.common})
    for stage in DATA_STAGES:
        done = run_dir / f".{stage}.done"
        if done.is_file():
            continue
        t0 = time.perf_counter()
        train(stage, stage, args, run_dir, args.devices[0], [], out / "logs" / "data.log")
        record_time(out, stage, time.perf_counter() - t0)
        done.touch()
    return run_dir


def seed_arm(run_dir: Path, arm_dir: Path):
    """The arm's directory with the data run's data, vocabulary and samples (copied once)."""
    if (arm_dir / ".seeded").is_file():
        return
    arm_dir.mkdir(parents=True, exist_ok=True)
    for name in SHARED:
        src, dst = run_dir / name, arm_dir / name
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, dst)
    (arm_dir / ".seeded").touch()


def train_arm(args, out: Path, run_dir: Path, name: str, sets: list[str], device: str):
    arm_dir = out / name
    check_settings(arm_dir, {"config": args.config_text, "set": args.common + sets})
    if (arm_dir / ".trained").is_file():
        return
    seed_arm(run_dir, arm_dir)
    log = out / "logs" / f"{name}.log"
    if not (arm_dir / ".vocab.done").is_file():  # seconds on the cached samples; an arm may change the vocabulary
        train(f"vocab {name}", "vocab", args, arm_dir, device, sets, log)
        (arm_dir / ".vocab.done").touch()
    t0 = time.perf_counter()
    train(f"fit {name}", "fit", args, arm_dir, device, sets, log)
    record_time(out, f"fit {name}", time.perf_counter() - t0)
    train(f"export {name}", "export", args, arm_dir, device, sets, log)
    (arm_dir / ".trained").touch()


def measure(args, out: Path, name: str, draft: Path, device: str):
    result = out / f"accept-{name}.json"
    if result.is_file():
        return
    bench_device, env = on_device(device, len(args.devices))
    partial = out / f".accept-{name}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_smollm2.py"), "--draft", str(draft), "--sections",
           "accept", "--accept-sets", str(args.accept_sets), "--device", bench_device, "--out", str(partial)]
    if args.accept_prompts:
        cmd += ["--accept-prompts", str(args.accept_prompts)]
    if args.new_tokens:
        cmd += ["--new-tokens", str(args.new_tokens)]
    run(f"acceptance of {name}", cmd, out / "logs" / f"accept-{name}.log", env)
    os.replace(partial, result)


def on_devices(jobs: list, devices: list[str]):
    """Run jobs (callables taking a device) spread round-robin over the devices, one at a time per listed
    device: a device listed twice (cuda:0,cuda:0) runs two jobs at once (two fits of the SmolLM2 recipe on one
    H200 did 0.92x the work of one after the other).
    Raises the first failure once every device has stopped."""
    queues = [(d, jobs[i::len(devices)]) for i, d in enumerate(devices)]
    errors = []

    def work(device, queue):
        for job in queue:
            try:
                job(device)
            except ArmError as e:
                errors.append(str(e))
                return

    threads = [threading.Thread(target=work, args=(d, q)) for d, q in queues if q]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise ArmError(errors[0])


def held_out(arm_dir: Path) -> float | None:
    path = arm_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    evals = [r["accept_length"] for r in rows if "accept_length" in r]
    return round(evals[-1], 3) if evals else None


def report(out: Path, arms: list[tuple[str, list[str]]], baseline: str | None) -> list[dict]:
    times = json.loads((out / "times.json").read_text()) if (out / "times.json").is_file() else {}
    rows = []
    names = ([("baseline", [f"draft {baseline}"])] if baseline else []) + arms
    for name, sets in names:
        acc = json.loads((out / f"accept-{name}.json").read_text()).get("accept", {})
        row = {"arm": name, "settings": " ".join(sets) or "(the recipe)",
               "held_out": None if name == "baseline" else held_out(out / name),
               "fit_s": times.get(f"fit {name}")}
        for dataset, res in acc.items():
            for spec in ("chain", "tree"):
                row[f"{dataset} {spec}"] = round(res[spec]["accept_length"], 3)
        rows.append(row)
    (out / "arms.json").write_text(json.dumps({"times": times, "rows": rows}, indent=2) + "\n")
    cols = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arm", action="append", default=[], help="NAME:SECTION.KEY=VALUE[:...] (repeatable)")
    ap.add_argument("--set", dest="common", action="append", default=[],
                    help="SECTION.KEY=VALUE for the data run and every arm (e.g. a smaller synth.num)")
    ap.add_argument("--baseline", help="a draft directory measured beside the arms (e.g. the committed asset)")
    ap.add_argument("--devices", default="cuda:0",
                    help="comma-separated: cuda:0,cuda:1 or cpu (a device listed twice runs two arms at once)")
    ap.add_argument("--accept-sets", type=int, default=2, choices=(1, 2))
    ap.add_argument("--accept-prompts", type=int, help="default: all (80 MT-bench, 164 HumanEval)")
    ap.add_argument("--new-tokens", type=int, help="default: bench_smollm2.py's (256)")
    args = ap.parse_args(argv)
    try:
        arms = [parse_arm(a) for a in args.arm]
        if not arms:
            raise ArmError("name at least one --arm")
        if len({n for n, _ in arms}) != len(arms):
            raise ArmError("two arms have the same name")
        if not Path(args.config).is_file():
            raise ArmError(f"no recipe at {args.config}")
        args.config = str(Path(args.config).resolve())  # the stages run in the repository's root
        args.config_text = Path(args.config).read_text()
        if args.baseline and not (Path(args.baseline) / "config.json").is_file():
            raise ArmError(f"no draft at {args.baseline} (config.json missing)")
        args.devices = [d.strip() for d in args.devices.split(",") if d.strip()]
        out = Path(args.out).expanduser().resolve()
        out.mkdir(parents=True, exist_ok=True)
        if args.baseline:
            args.baseline = str(Path(args.baseline).resolve())

        run_dir = make_data(args, out)
        on_devices([lambda d, n=n, s=s: train_arm(args, out, run_dir, n, s, d) for n, s in arms], args.devices)
        drafts = [(n, out / n / "draft") for n, _ in arms]
        if args.baseline:
            drafts.insert(0, ("baseline", Path(args.baseline)))
        on_devices([lambda d, n=n, p=p: measure(args, out, n, p, d) for n, p in drafts], args.devices)
        report(out, arms, args.baseline)
    except ArmError as e:
        print(f"train_arms: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
