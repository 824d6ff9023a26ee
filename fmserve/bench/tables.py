"""The benchmarks' result tables: printed with rich, and the same rows as markdown for a file;
their cells' numbers."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def print_table(console: Console, title: str, header: list[str], rows: list[list[str]]
                ) -> list[str]:
    """Print the rows right-aligned under `title`; return them as markdown lines."""
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return markdown_table(header, rows)


def fmt(value: float | None, digits: int = 1, why: str = "no data") -> str:
    if value is None or not math.isfinite(value):
        return f"skipped ({why})"
    return f"{value:,.{digits}f}"


def with_ratio(value: float | None, base: float | None, digits: int = 1) -> str:
    text = fmt(value, digits)
    if value is None or not math.isfinite(value):
        return text
    if base is None or not math.isfinite(base) or base <= 0:
        return f"{text} (ratio skipped: no baseline)"
    return f"{text} ({value / base:.2f}x)"
