"""Markdown tables of a benchmark run, headed by what produced it: hardware, versions, date, the command, the
commit and a digest of the sources. A script given `--markdown FILE` writes its tables there as it measures,
and docs/BENCHMARKS.md takes them as written (appended, not retyped), so no number in them passes through a
hand."""

from __future__ import annotations

import hashlib
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # not installed here (e.g. triton on a CPU-only machine): say so, do not fail the run
        return "absent"


def source_digest(root: Path = ROOT) -> str:
    """12 hex digits of sha256 over the Python files under src/ and benchmarks/ (paths and contents, in path
    order): the code that ran, whatever .git says. `python3 benchmarks/md_tables.py` prints it for a checkout,
    so a table can be matched to a commit."""
    h = hashlib.sha256()
    for path in sorted(p for d in ("src", "benchmarks") for p in (root / d).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _commit() -> str:
    """HEAD's short hash, "+ changes" when the tree differs from it (a copy of a working tree, as the GPU
    machines get, may carry a .git older than its files), or "unknown" outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + (" + changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def writable(path: str, script: str) -> str:
    """`path` if a file can be written there, else a one-line exit: checked before a run measures anything,
    not when its first table is due."""
    if path and not Path(path).resolve().parent.is_dir():
        raise SystemExit(f"{script}: no folder {str(Path(path).resolve().parent)!r} for {path!r}")
    return path


def run_header(device: str, argv: list[str] | None = None) -> str:
    """One paragraph: date, hardware, versions, commit and the exact command of this run."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        hardware = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        hardware = f"CPU ({platform.processor() or platform.machine()})"
    argv = sys.argv if argv is None else argv
    command = "python3 " + shlex.join(argv)
    return (f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {hardware}; torch {torch.__version__}, triton "
            f"{_version('triton')}, transformers {_version('transformers')}, Python {platform.python_version()}; "
            f"commit {_commit()}, source digest {source_digest()}. Command: `{command}`")


def table(headers: list[str], rows: list[list], right: set[int] | None = None) -> str:
    """A markdown table; columns whose index is in `right` (default: all but the first) align right."""
    right = set(range(1, len(headers))) if right is None else right
    rule = ["---:" if i in right else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"md_tables: a row of {len(row)} cells under {len(headers)} headers")
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3f}"
    return str(value)


def ratio(a: float | None, b: float | None) -> str:
    """a / b as '1.234×', or '' where either is missing."""
    return f"{a / b:.3f}×" if a and b else ""


if __name__ == "__main__":
    print(source_digest())
