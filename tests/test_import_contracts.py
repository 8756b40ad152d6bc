"""The import contracts in pyproject.toml ([tool.importlinter]) hold, and they catch an arrow that points up.

Imports point down (kernels <- layers <- models <- engine <- server/commands), ledger, launch, shell and bench
stay free of the model stack, and no two sibling packages or modules import each other. `lint-imports` reads every import,
function-level ones included.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("lint-imports")
    command = [str(script)] if script.exists() else [shutil.which("lint-imports") or "lint-imports"]
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([*command, "--no-cache", str(ROOT / "pyproject.toml")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    run = lint_imports(ROOT, ROOT / "src")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_a_kernel_importing_the_engine_breaks_them(tmp_path):
    """A copy of the package with one upward import (kernels -> engine) breaks the layering and the cycle
    contracts, and the report names the file."""
    shutil.copytree(ROOT / "src" / "eyas", tmp_path / "eyas", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "eyas" / "kernels" / "upward_probe.py").write_text("import eyas.engine.engine\n")
    run = lint_imports(tmp_path, tmp_path)
    assert run.returncode != 0
    assert "eyas.kernels.upward_probe -> eyas.engine.engine" in run.stdout
    assert "2 broken" in run.stdout, run.stdout
