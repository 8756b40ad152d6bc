"""One command of a pasted shell line: the words bash splits it into, and the program it starts.

Both halves of the reader build on these: shell_wrappers.py says what each simple command hands its program,
shell.py reads a whole line with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eyas.errors import EyasError
from eyas.shell.shell_lexer import Op, Word, is_redirection


@dataclass
class Dropped:
    """An assignment that does not reach the program it was written for."""

    name: str
    value: str
    reason: str


@dataclass
class Command:
    """One program the line starts, with the environment the line hands it."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set by the line; the program also gets inherited vars
    inherits_env: bool = True  # False after `env -i` or sudo's env_reset
    host: str | None = None  # the machine it runs on when reached through ssh
    ssh_options: list[str] = field(default_factory=list)  # ssh's -p/-i/-l/-o/-J as `-o` options (Port=2222)
    wrappers: list[str] = field(default_factory=list)  # e.g. ["ssh root@h", "nohup"]
    redirections: list[str] = field(default_factory=list)
    background: bool = False
    dropped: list[Dropped] = field(default_factory=list)
    problem: str | None = None  # why this will not run the way it reads

    @property
    def program(self) -> str | None:
        return self.argv[0] if self.argv else None

    @property
    def not_a_program(self) -> bool:
        """A "command" the shell fails to find: ' ' made by a `\\ `, or flags orphaned on a line of their own."""
        return bool(self.program is not None and (not self.program.strip() or self.program.startswith("-")))


@dataclass
class SimpleCommand:
    words: list[Word]
    redirections: list[str]
    terminator: str  # the control operator after it: ';', a newline, '&', '&&', '||', '|' or '' at the end


def split_simple_commands(tokens: list[Word | Op]) -> list[SimpleCommand]:
    commands: list[SimpleCommand] = []
    words: list[Word] = []
    redirs: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if isinstance(tok, Word):
            words.append(tok)
        elif is_redirection(tok):
            target = tokens[i + 1] if i + 1 < len(tokens) else None
            if not isinstance(target, Word):
                raise EyasError(f"redirection '{tok.text}' in the pasted line has no target")
            redirs.append(tok.text + ("" if tok.text.endswith("&") else " ") + target.text)
            i += 1
        else:
            if words or redirs:
                commands.append(SimpleCommand(words, redirs, tok.text))
            words, redirs = [], []
        i += 1
    if words or redirs:
        commands.append(SimpleCommand(words, redirs, ""))
    return commands
