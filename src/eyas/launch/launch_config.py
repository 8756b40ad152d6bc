"""A launch config: one TOML file that says exactly how a server was started, so it can be started that way again.

Usage: config = load_config("kimi-eagle3.toml"); print(config.to_toml())

    backend = "sglang"                      # eyas | sglang | vllm
    model = "/shared/kimi-k2.5-int4"        # paths as the serving host sees them
    draft = "/data/eagle3/output_100k_sglang/4"
    spec_steps = 2
    spec_topk = 1
    spec_draft_tokens = 3
    tp = 8
    host = "0.0.0.0"
    port = 8000
    python = "~/ml-env/bin/python3"         # the interpreter that runs the server (default: this one / python3)
    extra_args = ["--trust-remote-code", "--mem-fraction-static", "0.88", "--disable-custom-all-reduce"]
    env = { NCCL_PROTO = "LL", NCCL_ALGO = "Ring", NCCL_BUFFSIZE = 16777216 }
    [bench]
    dataset = "mt-bench"
    num_prompts = 80
    concurrency = 1
    max_tokens = 256

The 94 tok/s run was lost because its NCCL variables lived in a shell line: not exported, or eaten by a pasted
`\\ `. Here they are data: the server gets exactly the base login variables plus `env`, and `eyas launch` checks
that every server process received each of them.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from eyas.config import SpecConfig
from eyas.errors import EyasError

BACKENDS = ("eyas", "sglang", "vllm")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class BenchConfig:
    dataset: str = "mt-bench"
    num_prompts: int | None = None
    concurrency: int = 1
    max_tokens: int = 256

    def __post_init__(self):
        _check_types(self, "bench.")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise EyasError(f"bench.num_prompts must be at least 1, got {self.num_prompts}")
        if self.concurrency < 1:
            raise EyasError(f"bench.concurrency must be at least 1, got {self.concurrency}")
        if self.max_tokens < 1:
            raise EyasError(f"bench.max_tokens must be at least 1, got {self.max_tokens}")


@dataclass
class LaunchConfig:
    backend: str
    model: str
    draft: str | None = None
    spec_steps: int | None = None
    spec_topk: int | None = None
    spec_draft_tokens: int | None = None
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    python: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    bench: BenchConfig | None = None
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    # Run this exact line with `bash -c` instead of the command built from the fields above; `env` then lists what
    # the line means to set, which is verified in every process but not passed (the line sets its own). This is
    # how `eyas launch --from-shell --run` records, and replays, a launch the way it was really typed.
    shell_line: str | None = None

    def __post_init__(self):
        if isinstance(self.bench, dict):
            self.bench = BenchConfig(**_known(self.bench, BenchConfig, "bench."))
        # TOML users write NCCL_BUFFSIZE = 16777216; the environment only holds strings.
        if isinstance(self.env, dict):
            self.env = {k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in self.env.items()}
        _check_types(self, "")
        if self.backend not in BACKENDS:
            raise EyasError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not self.model.strip():
            raise EyasError("model must not be empty")
        if self.tp < 1:
            raise EyasError(f"tp must be at least 1, got {self.tp}")
        if not 1 <= self.port <= 65535:
            raise EyasError(f"port must be in 1..65535, got {self.port}")
        for key, value in self.env.items():
            if not ENV_KEY.match(key):
                raise EyasError(f"env key {key!r} is not a variable name")
            if not isinstance(value, str) or "\0" in value:
                raise EyasError(f"env.{key} must be a string (or an integer) without NUL bytes, got {value!r}")
        if not all(isinstance(a, str) for a in self.extra_args):
            raise EyasError(f"extra_args must be a list of strings, got {self.extra_args!r}")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise EyasError("startup_timeout_s and stop_timeout_s must be positive")
        self._normalize_speculation()

    def _normalize_speculation(self):
        given = {k: getattr(self, k) for k in ("spec_steps", "spec_topk", "spec_draft_tokens")}
        if self.draft is None:
            if any(v is not None for v in given.values()):
                raise EyasError("spec_steps/spec_topk/spec_draft_tokens need a draft")
            return
        for key in ("spec_steps", "spec_topk"):
            if given[key] is not None and given[key] < 1:  # a 0 is a value given, not one left to the default
                raise EyasError(f"{key} must be >= 1, got {given[key]}")
        if all(v is None for v in given.values()):
            return  # none named: the engine's own defaults (SGLang picks them per model), never invented here
        # Once one is named the rest are written out, so a record replays the same numbers.
        sc = SpecConfig(**{k.removeprefix("spec_"): v for k, v in given.items() if v is not None})
        if sc.topk == 1 and self.spec_draft_tokens not in (None, sc.draft_tokens):
            raise EyasError(f"spec_draft_tokens {self.spec_draft_tokens} is impossible with spec_topk 1: a chain of "
                            f"{sc.steps} steps verifies {sc.draft_tokens} tokens (steps + 1)")
        if self.backend == "vllm" and sc.topk != 1:
            raise EyasError("vLLM's eagle3 speculative config drafts a chain: spec_topk must be 1")
        self.spec_steps, self.spec_topk, self.spec_draft_tokens = sc.steps, sc.topk, sc.draft_tokens

    @property
    def speculative(self) -> bool:
        return self.draft is not None

    def without_speculation(self) -> LaunchConfig:
        return replace(self, draft=None, spec_steps=None, spec_topk=None, spec_draft_tokens=None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "launch config") -> LaunchConfig:
        return cls(**_known(d, cls, "", where))

    def to_toml(self) -> str:
        lines, bench = [], None
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "bench":
                bench = value
            elif value is not None and value != f.default and not (f.name in ("env", "extra_args") and not value):
                lines.append(f"{f.name} = {_toml_value(value)}")
        if bench is not None:
            lines += ["", "[bench]"] + [f"{k} = {_toml_value(v)}" for k, v in asdict(bench).items() if v is not None]
        return "\n".join(lines) + "\n"


def load_config(path: str | Path) -> LaunchConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise EyasError(f"no launch config at {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise EyasError(f"cannot read {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise EyasError(f"{path} is not valid TOML: {e}") from None
    try:
        config = LaunchConfig.from_dict(data, str(path))
    except TypeError as e:  # a required key is missing
        missing = re.search(r"missing \d+ required (?:positional |keyword-only )?arguments?: (.*)", str(e))
        raise EyasError(f"{path}: missing required key(s) {missing.group(1)}" if missing else f"{path}: {e}") from None
    except EyasError as e:
        raise EyasError(f"{path}: {e}") from None
    # A relative dataset path means "next to the config"; built-in names (mt-bench, humaneval) stay as they are.
    if config.bench and not Path(config.bench.dataset).is_absolute() and (path.parent / config.bench.dataset).is_file():
        config.bench.dataset = str((path.parent / config.bench.dataset).resolve())
    return config


def _known(d: dict, cls: type, prefix: str, where: str = "launch config") -> dict:
    names = [f.name for f in fields(cls)]
    unknown = [k for k in d if k not in names]
    if unknown:
        raise EyasError(f"unknown key '{prefix}{unknown[0]}' in the {where}: expected one of "
                        f"{', '.join(prefix + n for n in names)}")
    return dict(d)


_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "dict": (dict,), "list": (list,)}


def _check_types(obj: Any, prefix: str) -> None:
    """One clear error per mistyped key (TOML makes `tp = "8"` easy to write)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.name == "bench" or (value is None and "None" in str(f.type)):
            continue
        kind = str(f.type).split("[")[0].split(" ")[0]
        ok = isinstance(value, _TYPES[kind]) and not isinstance(value, bool)
        if not ok:
            raise EyasError(f"'{prefix}{f.name}' must be {'an' if kind == 'int' else 'a'} {kind}"
                            f"{'' if kind != 'float' else ' (seconds)'}, got {type(value).__name__} {value!r}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # JSON's escapes (\" \\ \n \t \uXXXX) are all valid in a TOML basic string.
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
