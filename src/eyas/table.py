"""Aligned plain-text tables for terminals and logs."""

from __future__ import annotations

_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"})


def one_line(text: object) -> str:
    """`text` with a newline, tab or carriage return written as \\n, \\t, \\r, so a value cannot break a row."""
    s = str(text)
    return s.translate(_ESCAPES) if any(c in s for c in "\n\t\r") else s


def clip(text: object, width: int = 48) -> str:
    """One line, at most `width` characters: long values (topology matrices, argv) would wreck the columns."""
    s = one_line(text)
    return s if len(s) <= width else s[: width - 1] + "…"


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    rows = [[one_line(c) for c in row] for row in rows]
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(headers, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)
