"""eyas.options declares every EYAS_* variable the package reads, and reads only what it declares."""

import ast
import re
from pathlib import Path

import pytest

from eyas import options

SRC = Path(__file__).resolve().parents[1] / "src" / "eyas"
NOT_SWITCHES = {"EYAS_API_KEY"}  # a secret's name, listed so the ledger redacts it; never read by eyas


def names_in_source() -> set[str]:
    """Every string constant of the package that is exactly an EYAS_* name."""
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"EYAS_[A-Z0-9_]+", node.value):
                found.add(node.value)
    return found


def test_every_name_in_the_source_is_declared():
    undeclared = names_in_source() - set(options.SWITCHES) - NOT_SWITCHES
    assert not undeclared, f"declare these in eyas.options.SWITCHES: {sorted(undeclared)}"


def test_every_declared_switch_is_used():
    unused = set(options.SWITCHES) - names_in_source()
    assert not unused, f"no code reads these any more; delete them from eyas.options: {sorted(unused)}"


def test_an_undeclared_name_is_refused(monkeypatch):
    monkeypatch.setenv("EYAS_NOT_A_SWITCH", "1")
    with pytest.raises(KeyError, match="EYAS_NOT_A_SWITCH"):
        options.get("EYAS_NOT_A_SWITCH")


def test_values_are_read_when_asked(monkeypatch):
    monkeypatch.delenv("EYAS_KERNELS", raising=False)
    assert options.get("EYAS_KERNELS") is None and options.current().get("EYAS_KERNELS") is None
    monkeypatch.setenv("EYAS_KERNELS", "0")
    assert options.get("EYAS_KERNELS") == "0" and options.current()["EYAS_KERNELS"] == "0"


def test_the_execution_plan_holds_the_ablations():
    """The shipped optimisations are execution plan fields (eyas.execution_plan), not environment switches."""
    from eyas import execution_plan

    for field in execution_plan.ExecutionPlan.__dataclass_fields__:
        assert f"EYAS_{field.upper()}" not in options.SWITCHES
    assert "EYAS_STEPS_IN_FLIGHT" not in options.SWITCHES and "EYAS_PROFILE" not in options.SWITCHES
