"""The server's one user-facing config, validated at the edge with one clear error per mistake."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from eyas.config import SpecConfig
from eyas.dist.worker import WorkerConfig
from eyas.errors import EyasError

ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env_pairs(pairs: list[str]) -> dict[str, str]:
    """['NCCL_PROTO=LL', ...] -> {'NCCL_PROTO': 'LL'}; a value may itself contain '='."""
    env = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not ENV_KEY.match(key):
            raise EyasError(f"--env expects KEY=VALUE with KEY a variable name, got {pair!r}")
        env[key] = value
    return env


@dataclass
class ServeConfig:
    model: str
    draft: str | None = None
    spec: SpecConfig | None = None
    tp: int = 1
    env: dict[str, str] = field(default_factory=dict)
    env_check: str = "fail"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_running: int = 8
    max_queue: int = 64
    max_model_len: int | None = None
    dtype: str | None = None
    device: str = "auto"
    profile: bool = False
    cuda_graphs: bool = True
    steps_in_flight: int = 2  # Steps queued at the workers at once (server/scheduler.py)

    def __post_init__(self):
        if self.tp < 1:
            raise EyasError(f"--tp must be >= 1, got {self.tp}")
        if self.env_check not in ("fail", "warn"):
            raise EyasError(f"--env-check must be fail or warn, got {self.env_check!r}")
        if not 0 <= self.port <= 65535:
            raise EyasError(f"--port must be in 0..65535, got {self.port}")
        if self.max_running < 1:
            raise EyasError(f"--max-running must be >= 1, got {self.max_running}")
        if type(self.steps_in_flight) is not int or self.steps_in_flight < 1:
            raise EyasError(f"--steps-in-flight must be a positive integer, not {self.steps_in_flight!r}")
        if self.max_queue < 0:
            raise EyasError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise EyasError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise EyasError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.spec is not None and self.draft is None:
            raise EyasError("speculative settings (--spec-steps/--spec-topk/--spec-draft-tokens/--spec-max-batch/"
                            "--[no-]spec-adaptive) need --draft")
        if self.draft is not None and self.spec is None:
            self.spec = SpecConfig()
        if self.api_key == "":
            raise EyasError("--api-key must not be empty")

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(model=self.model, dtype=self.dtype, device=self.device, draft=self.draft, spec=self.spec,
                            max_running=self.max_running, max_model_len=self.max_model_len, profile=self.profile,
                            cuda_graphs=self.cuda_graphs, env_keys=tuple(self.env))

    def public(self) -> dict:
        """For /server_info and the ledger: everything except the API key itself."""
        d = dataclasses.asdict(self)
        d["api_key"] = "(set)" if self.api_key else None
        return d
