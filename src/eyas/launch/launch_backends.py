"""Each backend's documented server command line, built from a launch config and read back from a pasted one.

Usage: build_command(config, python="python3") -> ["python3", "-m", "sglang.launch_server", "--model-path", ...]
       config_fields(["vllm", "serve", "/m", "--tensor-parallel-size", "2"]) -> {"backend": "vllm", "model": "/m", ...}

Flags, as documented by each project:
- SGLang: docs/advanced_features/server_arguments.md in sgl-project/sglang: `--model-path` (alias `--model`),
  `--tensor-parallel-size`/`--tp-size`, `--host`, `--port`, `--speculative-algorithm` (EAGLE, EAGLE3, ...),
  `--speculative-draft-model-path` (alias `--speculative-draft-model`), `--speculative-num-steps`,
  `--speculative-eagle-topk`, `--speculative-num-draft-tokens`. The entry point is `python -m sglang.launch_server`.
- vLLM: `vllm serve MODEL` (vllm/entrypoints/cli/main.py; `python -m vllm.entrypoints.cli.main serve` is the same
  program), `--tensor-parallel-size` (`-tp`), `--host`, `--port`, and `--speculative-config` JSON with `method`
  ("eagle3"), `model` (the draft) and `num_speculative_tokens` (docs.vllm.ai "Speculative Decoding" and the
  speculators "Serve in vLLM" tutorial).
- eyas: `python -m eyas.cli serve` (src/eyas/server/cli.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import PurePosixPath

from eyas.errors import EyasError
from eyas.launch.launch_config import LaunchConfig

# config field -> the flag each backend spells it with (first = the one we write; the rest are read back too)
FLAGS = {
    "eyas": {"model": ["--model"], "draft": ["--draft"], "spec_steps": ["--spec-steps"],
             "spec_topk": ["--spec-topk"], "spec_draft_tokens": ["--spec-draft-tokens"], "tp": ["--tp"],
             "host": ["--host"], "port": ["--port"]},
    "sglang": {"model": ["--model-path", "--model"],
               "draft": ["--speculative-draft-model-path", "--speculative-draft-model"],
               "spec_steps": ["--speculative-num-steps"], "spec_topk": ["--speculative-eagle-topk"],
               "spec_draft_tokens": ["--speculative-num-draft-tokens"],
               "tp": ["--tp-size", "--tensor-parallel-size", "--tp"], "host": ["--host"], "port": ["--port"],
               "algorithm": ["--speculative-algorithm", "--speculative-algo"]},
    "vllm": {"model": ["--model"], "tp": ["--tensor-parallel-size", "-tp"], "host": ["--host"], "port": ["--port"],
             "speculative_config": ["--speculative-config"]},
}
DEFAULT_PORT = {"eyas": 8000, "sglang": 30000, "vllm": 8000}
_INTS = {"spec_steps", "spec_topk", "spec_draft_tokens", "tp", "port"}


def _program_prefix(config: LaunchConfig, python: str) -> list[str]:
    if config.backend == "eyas":
        return [python, "-m", "eyas.cli", "serve"]
    if config.backend == "sglang":
        return [python, "-m", "sglang.launch_server"]
    # The `vllm` script is what people type; with an explicit interpreter we run the same CLI through it.
    return [python, "-m", "vllm.entrypoints.cli.main", "serve"] if config.python else ["vllm", "serve"]


def build_command(config: LaunchConfig, python: str | None = None) -> list[str]:
    """The server's argv. `python` is the interpreter when the config names none (this one, or python3 on a host)."""
    python = config.python or python or sys.executable
    managed = {flag for names in FLAGS[config.backend].values() for flag in names}
    for arg in config.extra_args:
        if arg.split("=", 1)[0] in managed:
            raise EyasError(f"extra_args sets {arg.split('=', 1)[0]}, which the launch config's own keys control: use "
                            f"model/draft/spec_*/tp/host/port instead")
    flag = {k: v[0] for k, v in FLAGS[config.backend].items()}
    argv = _program_prefix(config, python)
    if config.backend == "vllm":
        argv.append(config.model)
        if config.speculative:
            conf = {"method": "eagle3", "model": config.draft, "num_speculative_tokens": config.spec_steps}
            argv += [flag["speculative_config"], json.dumps({k: v for k, v in conf.items() if v is not None})]
    else:
        argv += [flag["model"], config.model]
        if config.speculative:
            if config.backend == "sglang":
                argv += [flag["algorithm"], "EAGLE3"]
            argv += [flag["draft"], config.draft]
            for key in ("spec_steps", "spec_topk", "spec_draft_tokens"):  # None: the engine's default
                if getattr(config, key) is not None:
                    argv += [flag[key], str(getattr(config, key))]
            if config.backend == "eyas" and not any(a.startswith("--spec-adaptive") for a in config.extra_args):
                # Speculate at every step, as SGLang and vLLM do with these settings: a launch (and a tune
                # sweep) measures the configuration it names. `--spec-adaptive` in extra_args opts back in.
                argv.append("--no-spec-adaptive")
    argv += [flag["tp"], str(config.tp), flag["host"], config.host, flag["port"], str(config.port)]
    return argv + list(config.extra_args)


def _name(word: str) -> str:
    return PurePosixPath(word).name


def detect(argv: list[str]) -> tuple[str, int, str | None]:
    """(backend, index of the first server argument, python) for a server command line."""
    for i, word in enumerate(argv[:-1]):
        if word == "-m":
            module, python = argv[i + 1], argv[0] if i == 1 else None
            rest = argv[i + 2:]
            if module == "eyas.cli" and rest[:1] == ["serve"]:
                return "eyas", i + 3, python
            if module == "sglang.launch_server":
                return "sglang", i + 2, python
            if module == "vllm.entrypoints.cli.main" and rest[:1] == ["serve"]:
                return "vllm", i + 3, python
            if module == "vllm.entrypoints.openai.api_server":  # vLLM's older entry point, still in its docs
                return "vllm", i + 2, python
    if argv and _name(argv[0]) in ("eyas", "vllm") and argv[1:2] == ["serve"]:
        return _name(argv[0]), 2, None
    raise EyasError(f"not a server command eyas knows ({' '.join(argv[:4])} ...): expected `eyas serve`, "
                    f"`python -m sglang.launch_server`, `vllm serve` or `python -m vllm.entrypoints.openai.api_server`")


def config_fields(argv: list[str]) -> dict:
    """Launch-config keys from a server command line; flags the config has no key for stay in extra_args, in order."""
    backend, start, python = detect(argv)
    by_flag = {f: key for key, names in FLAGS[backend].items() for f in names}
    out: dict = {"backend": backend, "python": python, "port": DEFAULT_PORT[backend]}
    extra: list[str] = []
    args = argv[start:]
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, value = word.partition("=")
        key = by_flag.get(name)
        if backend == "eyas" and word == "--no-spec-adaptive":  # what build_command writes for every eyas config
            i += 1
            continue
        if key is None:
            if backend == "vllm" and "model" not in out and not word.startswith("-"):
                out["model"] = word  # `vllm serve MODEL`
            else:
                extra.append(word)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(args):
                raise EyasError(f"{name} has no value")
            value, i = args[i + 1], i + 1
        i += 1
        if key == "algorithm":
            if value.upper() != "EAGLE3":
                raise EyasError(f"the line uses --speculative-algorithm {value}; launch configs describe EAGLE3 runs")
        elif key == "speculative_config":
            conf = _speculative_config(value)
            steps = conf.get("num_speculative_tokens")  # None: vLLM's default, left to it
            out.update(draft=conf["model"], spec_steps=steps, spec_topk=None if steps is None else 1)
        else:
            out[key] = _int(name, value) if key in _INTS else value
    out["extra_args"] = extra
    return {k: v for k, v in out.items() if v is not None}


def _int(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise EyasError(f"{flag} expects an integer, got {value!r}") from None


def _speculative_config(text: str) -> dict:
    try:
        conf = json.loads(text)
    except json.JSONDecodeError as e:
        raise EyasError(f"--speculative-config is not JSON: {e.msg}") from None
    if not isinstance(conf, dict) or str(conf.get("method", "")).lower() != "eagle3" or "model" not in conf:
        raise EyasError(f"--speculative-config {text} is not an eagle3 config with a draft model")
    return conf
