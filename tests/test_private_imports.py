"""No module uses another module's underscore names (STYLE.md), as ruff's rules in pyproject.toml [tool.ruff.lint]
check them: import-private-name (PLC2701) and private-member-access (SLF001) over src/eyas.

PLC2701 lets a module import private names from anywhere in its own top-level package, and every import here is
inside `eyas`. So the check runs on a copy of the package whose `__init__.py` files are renamed: with no package
root, ruff treats every module as outside every other one, and each cross-module `from eyas.x import _y` counts.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff_findings(package: Path, copy: Path) -> list[str]:
    """ruff's findings over `package` copied to `copy` without package markers, as 'path:line:col: message'
    with paths relative to the copy."""
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[test]')")
    for src in package.rglob("*.py"):
        name = "package_init.py" if src.name == "__init__.py" else src.name
        dst = copy / src.parent.relative_to(package.parent) / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                          "--config", str(ROOT / "pyproject.toml"), str(copy)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 1), run.stdout + run.stderr  # 1: findings; anything else: ruff itself failed
    return [line.replace(str(copy) + "/", "") for line in run.stdout.splitlines() if line.startswith(str(copy))]


def test_no_module_uses_another_modules_private_names(tmp_path):
    findings = ruff_findings(ROOT / "src" / "eyas", tmp_path)
    assert not findings, "\n".join(["private names used across modules (src/ relative):", *findings])


def test_a_private_import_and_a_private_attribute_are_caught(tmp_path):
    """A copy with one module importing another's private name and calling a private method of another
    module's object fails the check, naming both."""
    package = tmp_path / "src" / "eyas"
    shutil.copytree(ROOT / "src" / "eyas", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "engine" / "private_probe.py").write_text(
        "from eyas.engine.ahead import _State\n\n\ndef probe(decoder):\n"
        "    return _State, decoder._greedy_cycle\n")
    findings = ruff_findings(package, tmp_path / "flat")
    assert any("eyas/engine/private_probe.py:1:" in f and "_State" in f for f in findings), findings
    assert any("eyas/engine/private_probe.py:5:" in f and "_greedy_cycle" in f for f in findings), findings
    assert len(findings) == 2, findings
