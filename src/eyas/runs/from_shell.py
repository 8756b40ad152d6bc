"""Turn a pasted launch line into a launch spec, saying what the line really does on the way.

Usage: imported = import_line("ssh root@h 'NCCL_PROTO=LL python -m sglang.launch_server --model-path /m'")
       print(imported.explain()); print(imported.spec(as_intended=True).to_toml())

A line is read the way bash reads it (runs.shell.parse_shell_line): `NCCL_PROTO=LL; python ...` does not export
the variable, and a `\\ ` left over from a joined `\\`+newline continuation turns an assignment into a command name
so the server never starts. The spec of what the line *really* runs is the default; `as_intended` adds back every
assignment the line meant to set. When the line as pasted starts no server at all, its repaired reading is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eyas.errors import EyasError
from eyas.runs.launch_backends import spec_fields
from eyas.runs.launch_spec import LaunchSpec
from eyas.runs.shell import ParsedLine, parse_shell_line


@dataclass
class Imported:
    line: str
    parsed: ParsedLine  # the reading the spec comes from (the repaired one when the pasted line cannot run)
    fields: dict
    env: dict[str, str]  # what the server really gets from the line
    lost: dict[str, str]  # what the line meant to set but does not reach the server
    host: str | None  # ssh destination, when the line runs the server through ssh
    notes: list[str] = field(default_factory=list)

    @property
    def intended_env(self) -> dict[str, str]:
        return {**self.env, **self.lost}

    def spec(self, as_intended: bool = False) -> LaunchSpec:
        return LaunchSpec(**self.fields, env=self.intended_env if as_intended else dict(self.env))

    def explain(self) -> str:
        lines = [f"note: {n}" for n in self.notes] + [self.parsed.explain()]
        if self.lost:
            lines.append(f"the server does not get: {', '.join(f'{k}={v}' for k, v in self.lost.items())} "
                         f"(--as-intended puts them in the spec)")
        if self.host:
            lines.append(f"it runs on {self.host}: launch the spec there with `eyas launch SPEC --host {self.host}`")
        return "\n".join(lines)


def import_line(line: str) -> Imported:
    if not line.strip():
        raise EyasError("--from-shell needs the command line, in quotes")
    parsed = parse_shell_line(line)
    notes = []
    main = parsed.main
    if main is None:
        raise EyasError("the line runs no command")
    if main.problem:
        if parsed.as_intended is None or parsed.as_intended.main is None or parsed.as_intended.main.problem:
            raise EyasError(f"the line does not start a server: {main.problem}")
        notes.append(f"as pasted, the line starts no server ({main.problem.split(':')[0]}); "
                     f"reading it with the `\\ ` continuations repaired")
        parsed = parsed.as_intended
        main = parsed.main
    if not main.inherits_env:
        notes.append("the server does not inherit the caller's environment (env -i or sudo)")
    lost = {d.name: d.value for d in parsed.dropped if d.name not in main.env}
    return Imported(line, parsed, spec_fields(main.argv), dict(main.env), lost, main.host, notes)
