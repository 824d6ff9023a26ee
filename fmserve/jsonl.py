"""JSONL prompt files, read with errors that name the file and the line."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path


def jsonl_rows(path: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed row) for every non-blank line; a line that is not JSON, or a file
    that is not UTF-8 text, is a ValueError naming where."""
    with open(path, encoding="utf-8") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                except RecursionError:
                    raise ValueError(f"{path}:{lineno}: JSON nested too deeply") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text ({exc.reason}); give a JSONL file") from None


def read_prompts(path: str) -> list[str]:
    """The "prompt" string of every row of a JSONL file; a bad row is named by its line."""
    texts = []
    for lineno, row in jsonl_rows(path):
        if not (isinstance(row, dict) and isinstance(row.get("prompt"), str)):
            raise ValueError(f"{path}:{lineno}: each line needs a 'prompt' string")
        texts.append(row["prompt"])
    if not texts:
        raise ValueError(f"{path}: no prompts")
    return texts


def check_output_path(path: str, flag: str = "--output") -> None:
    """Refuse a results file that could not be written, before any work (the commands write it
    at the end: a batch's answers were lost to a missing directory). "-" is stdout. Nothing is
    created or truncated here, so a run that fails later leaves an existing file alone."""
    if path == "-":
        return
    target = Path(path).expanduser()
    parent = target.parent
    if target.is_dir():
        problem = "is a directory"
    elif not parent.is_dir():
        problem = (f"is in {parent}, which is not a directory" if parent.exists()
                   else f"is in {parent}, which does not exist")
    elif not os.access(target if target.exists() else parent, os.W_OK):
        problem = "cannot be written (no permission)"
    else:
        return
    raise ValueError(f"{flag} {path} {problem}: give a file path in an existing directory, "
                     f"or - for stdout")


def write_jsonl(path: str, rows: Iterable[object]) -> None:
    """One JSON line per row to `path` ("-" is stdout)."""
    out = sys.stdout if path == "-" else open(path, "w", encoding="utf-8")
    try:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
