"""The benchmarks' result tables: printed with rich, and the same rows as markdown for a file."""

from __future__ import annotations

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
