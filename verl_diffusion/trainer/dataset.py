"""Prompt datasets for image RL: no tokenizer, one row = one prompt (docs/data_flow.md).

Reads parquet (verl's layout: a ``prompt`` column holding a string or a chat list of
``{"role", "content"}``), jsonl (one object per line with ``prompt``) or txt (one prompt per line).
Optional columns travel with the row: ``negative_prompt``, ``data_source``, ``reward_model``, ``extra_info``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from verl_diffusion.prompt_files import prompt_text, read_rows  # noqa: F401  (re-exported)

ROW_KEYS = ("prompt", "negative_prompt", "data_source", "reward_model", "extra_info")
# What the rewards read of a row (the ground truth in reward_model, extra_info, data_source), in training,
# validation and python -m verl_diffusion.sample alike.
METADATA_KEYS = ("reward_model", "extra_info", "data_source")


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
