"""Prompt files (.parquet / .jsonl / .json / .txt) read into rows, with one line naming the file and the row for
what is wrong in them. The config checks count the prompts with it before Ray starts; the trainer's datasets read
the same rows.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def prompt_text(value: Any) -> str:
    """A prompt cell as text: a string, or the last user message of a chat list."""
    if isinstance(value, str):
        return value
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and value:
        users = [m for m in value if isinstance(m, dict) and m.get("role", "user") == "user"]
        msg = (users or list(value))[-1]
        return str(msg.get("content", "")) if isinstance(msg, dict) else str(msg)
    raise ValueError(f"prompt cell {value!r} is neither a string nor a chat list of {{'role','content'}}")


def _text_lines(path: str):
    """(line number, text) of a text file; invalid UTF-8 raises one line naming the file and line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"prompt file {path!r} line {lineno}: not valid UTF-8 ({e.reason} at byte "
                                 f"{e.start}); save it as UTF-8") from None


def read_rows(path: str, *, prompt_key: str = "prompt") -> list[dict]:
    """Rows of a prompt file (.parquet / .jsonl / .json / .txt).

    Raises one line naming the file (and the line or row) for: a missing file, an unknown extension, invalid
    UTF-8, malformed JSON / parquet, a missing prompt column, a null or empty prompt cell."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist (data.train_files / data.val_files)")
    where: list[str] = []  # "line N" / "row N" of each row, for the messages below
    if path.endswith(".txt"):
        rows = []
        for lineno, text in _text_lines(path):
            if text.strip():
                rows.append({prompt_key: text.strip()})
                where.append(f"line {lineno}")
    elif path.endswith(".jsonl"):
        rows = []
        for lineno, text in _text_lines(path):
            if not text.strip():
                continue
            try:
                row = json.loads(text.strip())
            except json.JSONDecodeError as e:
                raise ValueError(f"prompt file {path!r} line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"prompt file {path!r} line {lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
            where.append(f"line {lineno}")
    elif path.endswith(".json"):
        text = "".join(t for _, t in _text_lines(path))
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompt file {path!r} line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"prompt file {path!r}: expected a JSON list of objects")
        where = [f"item {i}" for i in range(len(rows))]
    elif path.endswith(".parquet"):
        import pandas as pd

        try:
            rows = pd.read_parquet(path).to_dict(orient="records")
        except Exception as e:  # pyarrow raises its own error types for a damaged or non-parquet file
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"prompt file {path!r} is not a readable parquet file ({msg})") from None
        where = [f"row {i}" for i in range(len(rows))]
    else:
        raise ValueError(f"prompt file {path!r}: unknown extension; use .parquet, .jsonl, .json or .txt")
    if not rows:
        raise ValueError(f"prompt file {path!r} holds no prompts (empty, or blank lines only)")
    if prompt_key not in rows[0]:
        raise ValueError(f"prompt file {path!r} has no {prompt_key!r} column (columns: {sorted(rows[0])}); "
                         f"set data.prompt_key or add the column")
    for row, at in zip(rows, where):
        cell = row.get(prompt_key)
        try:
            text = prompt_text(cell)
        except ValueError:
            text = None
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"prompt file {path!r} {at}: the {prompt_key!r} cell is {cell!r}; every row needs a "
                             "non-empty prompt (a string or a chat list)")
    return rows
