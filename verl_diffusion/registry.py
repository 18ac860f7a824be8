"""The only module that touches verl's registries (DESIGN §4, §5). Filled in by register_all()."""

_DONE = False


def register_all() -> None:
    """Register platform, advantage estimators, policy losses, engine and rewards into verl. Idempotent."""
    global _DONE
    if _DONE:
        return
    _DONE = True
