"""FSDP2 parameters back to their shards before anything reads or writes them directly."""

from __future__ import annotations

import contextlib


def reshard(engine) -> None:
    """With ``reshard_after_forward=false`` FSDP2 keeps unsharded parameters after a no-grad forward; reshard
    before anything reads or writes the sharded parameters directly (EMA / θ_old swap, checkpoint).
    ``FSDPModule.reshard()`` is not recursive: reshard every FSDP-wrapped submodule (the blocks), not only the root."""
    module = getattr(engine, "module", None)
    if module is None:
        return
    for m in module.modules():
        if hasattr(m, "reshard") and callable(m.reshard) and hasattr(m, "unshard"):
            m.reshard()


@contextlib.contextmanager
def resharded_swap(engine, holder):
    """``holder.swap_in()`` on the sharded parameters: reshard before swapping in and before restoring."""
    reshard(engine)
    with holder.swap_in():
        try:
            yield
        finally:
            reshard(engine)
