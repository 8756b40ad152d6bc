"""Split a pasted POSIX shell line into words and operators the way bash does.

shlex.split(posix=True) gets the words right but forgets which characters were quoted, and that is exactly what
decides the traps we care about: `A=1` is an assignment but `"A"=1`, `\\A=1` and `\\ A=1` are command names, and
`;` is an operator but `';'` is an argument. So this lexer keeps, per character, whether it came from quoting.
Expansions ($VAR, $(...), backticks, a leading ~) are kept as literal text and flagged: we describe a line, we do
not run it. Tests check words against shlex.split and meanings against a real bash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eyas.errors import EyasError

_NAME_EQ = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")

# Longest first, so `&>>` is not read as `&` then `>>`.
_OPERATORS = ("&>>", "<<<", "<<-", "&&", "||", "|&", ";;", "&>", ">>", ">&", ">|", "<<", "<&", "<>",
              ";", "&", "|", "(", ")", "<", ">")
REDIRECTIONS = frozenset({"&>>", "<<<", "<<-", "&>", ">>", ">&", ">|", "<<", "<&", "<>", "<", ">"})

_ANSI_C = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "e": "\x1b", "E": "\x1b", "f": "\f",
           "v": "\v", "\\": "\\", "'": "'", '"': '"', "?": "?"}


@dataclass(frozen=True)
class Word:
    text: str
    quoted: tuple[bool, ...]  # per character of text: produced by quotes or a backslash escape
    expands: bool = False  # holds $VAR, $(...), `...` or a leading ~, left unexpanded

    def assignment(self) -> tuple[str, str] | None:
        """(name, value) if the shell would read this word as NAME=value: name and '=' must be unquoted."""
        m = _NAME_EQ.match(self.text)
        if m and not any(self.quoted[: m.end()]):
            return m.group(1), self.text[m.end():]
        return None

    def looks_like_assignment(self) -> tuple[str, str] | None:
        """(name, value) if the word reads as NAME=value to a human, ignoring quoting and leading blanks."""
        m = _NAME_EQ.match(self.text.lstrip())
        return (m.group(1), self.text.lstrip()[m.end():]) if m else None

    @property
    def escaped_leading_space(self) -> bool:
        """True for words like ' NAME=1' that a `\\ ` produced: the backslash glued a space onto the word."""
        return bool(self.text) and self.text[0] in " \t" and self.quoted[0]


@dataclass(frozen=True)
class Op:
    text: str  # an operator such as ';', '&', '&&', '|', '>', '2>', '>&'


class _WordBuilder:
    def __init__(self) -> None:
        self.chars: list[str] = []
        self.quoted: list[bool] = []
        self.started = False  # '' is a word: an empty pair of quotes still makes an (empty) argument
        self.expands = False

    def add(self, text: str, quoted: bool) -> None:
        self.chars.extend(text)
        self.quoted.extend([quoted] * len(text))
        self.started = True

    def is_io_number(self) -> bool:
        return bool(self.chars) and all(c.isdigit() for c in self.chars) and not any(self.quoted)

    def take(self) -> Word | None:
        if not self.started:
            return None
        word = Word("".join(self.chars), tuple(self.quoted), self.expands)
        self.__init__()
        return word


def _closing(line: str, start: int, opener: str, closer: str) -> int:
    """Index just past the `closer` matching the `opener` at line[start - 1], skipping quoted text."""
    depth, i = 1, start
    while i < len(line):
        c = line[i]
        if c == "\\":
            i += 2
            continue
        if c == "'" and opener != "`":
            end = line.find("'", i + 1)
            i = (end if end >= 0 else len(line)) + 1
            continue
        if c == closer:
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == opener and opener != closer:
            depth += 1
        i += 1
    raise EyasError(f"unterminated {opener}...{closer} in the pasted line")


def _ansi_c(line: str, i: int, word: _WordBuilder) -> int:
    """Read $'...' starting at the quote (i points past the $); returns the index after the closing quote."""
    i += 1
    while i < len(line):
        c = line[i]
        if c == "'":
            return i + 1
        if c == "\\" and i + 1 < len(line):
            nxt = line[i + 1]
            if nxt == "x":
                m = re.match(r"[0-9a-fA-F]{1,2}", line[i + 2:])
                if m:
                    word.add(chr(int(m.group(), 16)), True)
                    i += 2 + m.end()
                    continue
            if nxt in "01234567":
                m = re.match(r"[0-7]{1,3}", line[i + 1:])
                word.add(chr(int(m.group(), 8)), True)
                i += 1 + m.end()
                continue
            word.add(_ANSI_C.get(nxt, "\\" + nxt), True)
            i += 2
            continue
        word.add(c, True)
        i += 1
    raise EyasError("unterminated $'...' quote in the pasted line")


def _double_quoted(line: str, i: int, word: _WordBuilder) -> int:
    """Read "..." starting just past the opening quote; returns the index after the closing quote."""
    while i < len(line):
        c = line[i]
        if c == '"':
            return i + 1
        if c == "\\" and i + 1 < len(line) and line[i + 1] in '$`"\\\n':
            if line[i + 1] != "\n":  # backslash-newline inside double quotes is a continuation
                word.add(line[i + 1], True)
            i += 2
            continue
        if c == "$" and i + 1 < len(line) and line[i + 1] in "({":
            end = _closing(line, i + 2, line[i + 1], ")" if line[i + 1] == "(" else "}")
            word.add(line[i:end], True)
            word.expands, i = True, end
            continue
        if c == "`":
            end = _closing(line, i + 1, "`", "`")
            word.add(line[i:end], True)
            word.expands, i = True, end
            continue
        if c == "$" and i + 1 < len(line) and (line[i + 1].isalnum() or line[i + 1] in "_@*#?$!-"):
            word.expands = True
        word.add(c, True)
        i += 1
    raise EyasError('unterminated double quote in the pasted line')


def tokenize(line: str) -> list[Word | Op]:
    """Words and operators of `line`; a newline is the operator '\\n', which ends a command as ';' does."""
    tokens: list[Word | Op] = []
    word = _WordBuilder()
    i, n = 0, len(line)

    def end_word() -> None:
        w = word.take()
        if w is not None:
            tokens.append(w)

    while i < n:
        c = line[i]
        if c == "\\":
            if i + 1 < n and line[i + 1] == "\n":  # a real line continuation vanishes entirely
                i += 2
            elif i + 1 < n:
                word.add(line[i + 1], True)
                i += 2
            else:
                word.add("\\", False)
                i += 1
        elif c == "'":
            end = line.find("'", i + 1)
            if end < 0:
                raise EyasError("unterminated single quote in the pasted line")
            word.add(line[i + 1:end], True)
            word.started, i = True, end + 1
        elif c == '"':
            word.started = True
            i = _double_quoted(line, i + 1, word)
        elif c == "$" and i + 1 < n and line[i + 1] == "'":
            word.started = True
            i = _ansi_c(line, i + 1, word)
        elif c == "$" and i + 1 < n and line[i + 1] in "({":
            end = _closing(line, i + 2, line[i + 1], ")" if line[i + 1] == "(" else "}")
            word.add(line[i:end], False)
            word.expands, i = True, end
        elif c == "`":
            end = _closing(line, i + 1, "`", "`")
            word.add(line[i:end], False)
            word.expands, i = True, end
        elif c in " \t":
            end_word()
            i += 1
        elif c == "\n":
            end_word()
            tokens.append(Op("\n"))
            i += 1
        elif c == "#" and not word.started:
            nl = line.find("\n", i)
            i = n if nl < 0 else nl
        elif c in ";&|()<>":
            op = next(o for o in _OPERATORS if line.startswith(o, i))
            prefix = ""
            if op in REDIRECTIONS and word.is_io_number():  # `2>&1`: the 2 belongs to the operator
                prefix = "".join(word.chars)
                word.take()
            end_word()
            tokens.append(Op(prefix + op))
            i += len(op)
        else:
            if (c == "$" and i + 1 < n and (line[i + 1].isalnum() or line[i + 1] in "_@*#?$!-")) or (
                    c == "~" and not word.started):  # ~/venv/bin/python is the user's home, not a literal ~
                word.expands = True
            word.add(c, False)
            i += 1
    end_word()
    return tokens


def is_redirection(op: Op) -> bool:
    return op.text.lstrip("0123456789") in REDIRECTIONS
