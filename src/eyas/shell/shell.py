"""Shell command lines: write the one that reproduces a run, and read the one a user pasted.

Usage:
    command_line(["eyas", "serve", "--model", "/m"], {"NCCL_PROTO": "LL"})
        -> "env NCCL_PROTO=LL eyas serve --model /m"
    parse_shell_line("ssh h 'NCCL_PROTO=LL \\ NCCL_ALGO=Ring python x.py'").explain()

The 94 tok/s configuration was lost twice over: NCCL variables that never reached the workers, and a pasted command
whose `\\ ` (a line continuation that lost its newline) silently turned an assignment into a command name. Writing
commands with one quoting function and reading them the way bash does are the two halves of not losing it again.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from eyas.shell.shell_command import Command, Dropped, split_simple_commands
from eyas.shell.shell_lexer import tokenize
from eyas.shell.shell_wrappers import Context, run_simple_commands


def quote(value: object) -> str:
    """The one quoting function: a word bash (or any POSIX shell) reads back as exactly `value`."""
    # shlex.quote single-quotes anything unsafe and spells a single quote as '"'"'; inside single quotes nothing
    # ($, `, \, newline) is special, which is what makes it safe for hostile values.
    return shlex.quote(str(value))


def command_line(argv: list[str], env: dict[str, str]) -> str:
    """The exact command that reproduces a run: `env 'A=x y' B=1 eyas serve ...`.

    Variables go through `env` rather than as bare `A=1 cmd` prefixes because `env` makes them part of the
    argv: the line still works after `nohup`, `sudo`, `ssh host` or in fish/csh, where bare prefixes do not.
    """
    assigns = [quote(f"{k}={v}") for k, v in sorted(env.items())]
    return " ".join((["env"] + assigns if assigns else []) + [quote(a) for a in argv])


def clip_command(argv: list[str], width: int = 200) -> str:
    """The quoted command for a log line, cut only between arguments: `a b c ... (+3 more arguments)`."""
    words: list[str] = []
    for i, arg in enumerate(argv):
        word = quote(arg)
        if words and len(" ".join(words)) + 1 + len(word) > width:
            return " ".join(words) + f" ... (+{len(argv) - i} more arguments)"
        words.append(word)
    return " ".join(words)


# Commands that accompany the real work on a pasted line (`...; echo started`); they are never "the" program.
_INCIDENTAL = {"echo", "printf", "sleep", "wait", "true", "false", ":", "cd", "pwd", "cat", "tail", "head", "ls",
               "mkdir", "rm", "kill", "pkill", "tee", "sync", "date", "source", ".", "ulimit", "umask", "ps"}


@dataclass
class ParsedLine:
    line: str
    commands: list[Command]
    dropped: list[Dropped]  # every lost assignment on the line, one reason each
    notes: list[str] = field(default_factory=list)
    as_intended: ParsedLine | None = None  # the same line with its broken `\\`+newline continuations repaired

    @property
    def main(self) -> Command | None:
        """The program the line is about: the first that is not an incidental echo/sleep/cd, nor a failed ' '."""
        real = [c for c in self.commands if c.program and c.program.strip().rsplit("/", 1)[-1] not in _INCIDENTAL]
        for cmd in real:
            if not cmd.not_a_program:
                return cmd
        return real[0] if real else self.commands[-1] if self.commands else None

    @property
    def env(self) -> dict[str, str]:
        return dict(self.main.env) if self.main else {}

    @property
    def argv(self) -> list[str]:
        return list(self.main.argv) if self.main else []

    def explain(self) -> str:
        lines = []
        for cmd in self.commands:
            where = f" on {cmd.host}" if cmd.host else ""
            lines.append(f"runs{where}: {' '.join(quote(a) for a in cmd.argv)}")
            if cmd.wrappers:
                lines.append(f"  through: {' -> '.join(cmd.wrappers)}")
            for k, v in cmd.env.items():
                lines.append(f"  gets {k}={v}")
            if not cmd.inherits_env:
                lines.append("  does not inherit the caller's environment")
            if cmd.redirections or cmd.background:
                lines.append(f"  io: {' '.join(cmd.redirections + (['&'] if cmd.background else []))}")
            if cmd.problem:
                lines.append(f"  PROBLEM: {cmd.problem}")
        lines += [f"lost {d.name}={d.value}: {d.reason}" for d in self.dropped]
        lines += [f"note: {n}" for n in self.notes]
        if self.as_intended is not None:
            lines.append("probably meant (with the `\\ ` continuations repaired):")
            lines += ["  " + ln for ln in self.as_intended.explain().splitlines()]
        return "\n".join(lines)


def parse_shell_line(line: str) -> ParsedLine:
    """Read a pasted POSIX shell line the way bash would, and say what each program really receives."""
    ctx = Context()
    commands = run_simple_commands(split_simple_commands(tokenize(line)), None, {}, ctx)
    parsed = ParsedLine(line, commands, _dedupe(ctx.dropped + [d for c in commands for d in c.dropped]), ctx.notes)
    repaired = repair_continuations(line)
    if repaired != line and any(c.problem and "`\\ `" in c.problem for c in commands):
        parsed.as_intended = parse_shell_line(repaired)
    return parsed


def repair_continuations(line: str) -> str:
    """The line with every broken `\\`+newline continuation made whole again.

    Two forms: `\\ ` then the newline (a space after the backslash: it escapes the space, and the newline ends the
    command there), and `A=1 \\ B=2 cmd` (a paste or a chat joined the lines, the newline became a space). A tab
    after the backslash does the same as a space.
    """
    line = re.sub(r"[ \t]*\\[ \t]+\n", " \\\n", line)
    return re.sub(r"(?<=[ \t])\\[ \t]", " ", line)


def _dedupe(dropped: list[Dropped]) -> list[Dropped]:
    seen, out = set(), []
    for d in dropped:
        if (d.name, d.reason) not in seen:
            seen.add((d.name, d.reason))
            out.append(d)
    return out
