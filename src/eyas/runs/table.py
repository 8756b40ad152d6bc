"""Aligned plain-text tables for terminals and logs."""

from __future__ import annotations


def clip(text: object, width: int = 48) -> str:
    """One line, at most `width` characters: long values (topology matrices, argv) would wreck the columns."""
    s = " ".join(str(text).split()) if "\n" in str(text) else str(text)
    return s if len(s) <= width else s[: width - 1] + "…"


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(headers, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)
