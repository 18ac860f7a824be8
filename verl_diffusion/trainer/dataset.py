"""Prompt datasets for image RL: no tokenizer, one row = one prompt (docs/data_flow.md).

Reads parquet (verl's layout: a ``prompt`` column holding a string or a chat list of
``{"role", "content"}``), jsonl (one object per line with ``prompt``) or txt (one prompt per line).
Optional columns travel with the row: ``negative_prompt``, ``data_source``, ``reward_model``, ``extra_info``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

ROW_KEYS = ("prompt", "negative_prompt", "data_source", "reward_model", "extra_info")
# What the rewards read of a row (the ground truth in reward_model, extra_info, data_source), in training,
# validation and python -m verl_diffusion.sample alike.
METADATA_KEYS = ("reward_model", "extra_info", "data_source")


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


class PromptDataset(Dataset):
    """Prompt rows; ``__getitem__`` returns a dict with ``prompt`` (text) and the optional columns."""

    def __init__(self, files: Sequence[str] | str, *, prompt_key: str = "prompt", max_samples: int = -1):
        files = [files] if isinstance(files, str) else list(files)
        self.rows: list[dict] = []
        for f in files:
            self.rows.extend(read_rows(str(f), prompt_key=prompt_key))
        if max_samples is not None and max_samples > 0:
            self.rows = self.rows[:max_samples]
        if not self.rows:
            raise ValueError(f"prompt files {files} hold no rows")
        self.prompt_key = prompt_key

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        out = {"prompt": prompt_text(row[self.prompt_key]), "index": i}
        for k in ROW_KEYS[1:]:
            if k in row and row[k] is not None:
                out[k] = row[k]
        out.setdefault("data_source", "prompts")
        return out


def collate_prompts(items: list[dict]) -> dict:
    """List of rows → dict of numpy object arrays (verl's non-tensor batch layout)."""
    keys = sorted({k for it in items for k in it})
    out = {}
    for k in keys:
        arr = np.empty(len(items), dtype=object)
        for i, it in enumerate(items):
            arr[i] = it.get(k, None)
        out[k] = arr
    return out


class EpochShuffleSampler(Sampler):
    """A permutation per epoch from ``seed + epoch`` (like DistributedSampler.set_epoch), with a state.

    The order of any epoch depends only on (seed, epoch), so a resumed run sees the same prompts as an
    uninterrupted one, also when verl skips restoring the dataloader at an epoch boundary (the trainer then
    sets ``epoch`` from the global step).
    """

    def __init__(self, n: int, seed: int = 1, shuffle: bool = True):
        self.n, self.seed, self.shuffle = int(n), int(seed), bool(shuffle)
        self.epoch = 0
        self._offset = 0
        self._yielded = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(self.n))
        start, self._offset = self._offset, 0
        self._yielded = start
        for idx in order[start:]:
            self._yielded += 1
            yield idx
        self.epoch += 1
        self._yielded = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "yielded": self._yielded}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self._offset = int(state.get("yielded", 0))

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._offset, self._yielded = int(epoch), 0, 0


def build_dataloaders(config):
    """(train dataset, val dataset, train sampler, train dataloader, val dataloader) of a run config: prompt rows
    (no tokenizer), an epoch-seeded shuffle (``EpochShuffleSampler``: a resume reproduces the order), the whole
    validation set in one batch. A train batch larger than the prompt set is refused."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = config.data
    key = data.get("prompt_key", "prompt")
    train = PromptDataset(list(data.train_files), prompt_key=key, max_samples=data.get("train_max_samples", -1))
    val = PromptDataset(list(data.val_files), prompt_key=key, max_samples=data.get("val_max_samples", -1))
    sampler = EpochShuffleSampler(len(train), seed=int(data.get("seed", 1)), shuffle=bool(data.get("shuffle", True)))
    train_dl = StatefulDataLoader(train, batch_size=int(data.train_batch_size), sampler=sampler, drop_last=True,
                                  collate_fn=collate_prompts, num_workers=0)
    val_dl = StatefulDataLoader(val, batch_size=len(val), shuffle=False, collate_fn=collate_prompts, num_workers=0)
    if len(train_dl) < 1:
        raise ValueError(f"data.train_batch_size={data.train_batch_size} is larger than the {len(train)} training "
                         "prompts")
    return train, val, sampler, train_dl, val_dl
