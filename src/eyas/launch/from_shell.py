"""Turn a pasted launch line into a launch config, saying what the line really does on the way.

Usage: imported = import_line("ssh root@h 'NCCL_PROTO=LL python -m sglang.launch_server --model-path /m'")
       print(imported.explain()); print(imported.config(as_intended=True).to_toml())

A line is read the way bash reads it (runs.shell.parse_shell_line): `NCCL_PROTO=LL; python ...` does not export
the variable, and a broken `\\`+newline continuation (a space after the backslash, or the newline lost in a paste)
ends the command early or turns an assignment into a command name. The first line of explain() says whether the
line, as pasted, starts a server at all. The config of what the line *really* runs is the default; `as_intended` adds
back every assignment the line meant to set. When the line as pasted starts no server, its repaired reading is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eyas.errors import EyasError
from eyas.launch.launch_backends import config_fields
from eyas.launch.launch_config import LaunchConfig
from eyas.shell.shell import ParsedLine, parse_shell_line, quote
from eyas.shell.shell_command import Command

_SPEC_KEYS = ("spec_steps", "spec_topk", "spec_draft_tokens")
_ENGINE_DEFAULTS = {
    "sglang": "SGLang's defaults (it picks them per model architecture)",
    "vllm": "vLLM's default num_speculative_tokens",
    "eyas": "eyas serve's defaults",
}
# SGLang's own warning when it overrides the given draft-token count for a chain (server_args.py).
SGLANG_TOPK1_WARNING = ("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                        "speculative_eagle_topk == 1")


@dataclass
class Imported:
    line: str
    pasted: ParsedLine  # the line read exactly as pasted
    parsed: ParsedLine  # the reading the config comes from (the repaired one when the pasted line cannot run)
    fields: dict
    env: dict[str, str]  # what the server really gets from the line
    lost: dict[str, str]  # what the line meant to set but does not reach the server
    host: str | None  # ssh destination, when the line runs the server through ssh
    ssh_options: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def starts_server(self) -> bool:
        """Whether the line as pasted starts the server (perhaps without some of its variables)."""
        return self.parsed is self.pasted

    @property
    def intended_env(self) -> dict[str, str]:
        return {**self.env, **self.lost}

    def config(self, as_intended: bool = False) -> LaunchConfig:
        return LaunchConfig(**self.fields, env=self.intended_env if as_intended else dict(self.env))

    def verdict(self) -> str:
        backend = self.fields["backend"]
        if not self.starts_server:
            return f"as pasted, the line starts no server: {self.pasted.main.problem}"
        if self.lost:
            return (f"as pasted, the line starts the {backend} server, but without "
                    f"{', '.join(f'{k}={v}' for k, v in self.lost.items())}")
        return f"as pasted, the line starts the {backend} server"

    def host_arguments(self) -> str:
        return " ".join([f"--host {quote(self.host)}"] + [f"--ssh-option {quote(o)}" for o in self.ssh_options])

    def explain(self) -> str:
        lines = [self.verdict(), self.pasted.explain()]
        if not self.starts_server:
            lines.append("the launch config below is that repaired reading")
        lines += [f"note: {n}" for n in self.notes]
        if self.lost:
            lines.append(f"the server does not get: {', '.join(f'{k}={v}' for k, v in self.lost.items())} "
                         f"(--as-intended puts them in the launch config)")
        if self.host:
            lines.append(f"it runs on {self.host}: launch the config there with "
                         f"`eyas launch CONFIG.toml {self.host_arguments()}`")
        return "\n".join(lines)


def _speculation_notes(fields: dict) -> list[str]:
    """Leave unnamed speculative numbers to the engine; apply SGLang's own topk-1 adjustment, as it does."""
    if "draft" not in fields:
        return []
    backend = fields["backend"]
    if not any(k in fields for k in _SPEC_KEYS):
        return [f"the line names no speculative numbers: the launch config leaves them unset, so the server runs with "
                f"{_ENGINE_DEFAULTS[backend]}"]
    steps, topk, tokens = (fields.get(k) for k in _SPEC_KEYS)
    if topk == 1 and steps is not None and tokens is not None and tokens != steps + 1:
        fields["spec_draft_tokens"] = steps + 1
        who = "SGLang" if backend == "sglang" else "eyas serve"
        return [f"--speculative-num-draft-tokens {tokens} with topk 1 and {steps} steps: {who} runs a chain of "
                f"{steps + 1} tokens instead and logs \"{SGLANG_TOPK1_WARNING}\"; the launch config says {steps + 1}"]
    return []


def _server(parsed: ParsedLine) -> Command:
    main = parsed.main
    if main is None:
        raise EyasError("the line runs no command")
    return main


def import_line(line: str) -> Imported:
    if not line.strip():
        raise EyasError("--from-shell needs the command line, in quotes")
    pasted = parsed = parse_shell_line(line)
    main = _server(pasted)
    if main.problem:
        repaired = pasted.as_intended
        if repaired is None or repaired.main is None or repaired.main.problem:
            raise EyasError(f"the line does not start a server: {main.problem}")
        parsed, main = repaired, repaired.main
    fields = config_fields(main.argv)
    notes = _speculation_notes(fields)
    if not main.inherits_env:
        notes.append("the server does not inherit the caller's environment (env -i or sudo)")
    lost = {d.name: d.value for d in parsed.dropped if d.name not in main.env}
    if parsed is not pasted:  # what the pasted line lost counts too: the repaired reading may not show it
        lost.update({d.name: d.value for d in pasted.dropped if d.name not in main.env and d.name not in lost})
    return Imported(line, pasted, parsed, fields, dict(main.env), lost, main.host, list(main.ssh_options), notes)
