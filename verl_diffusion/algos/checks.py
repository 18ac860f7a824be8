"""Validation helpers of the pure core: one teaching line per bad value."""

from __future__ import annotations

from typing import Any


def check_choice(field_name: str, value: Any, choices) -> None:
    """One teaching line for an unknown name: the field, the value and what is accepted."""
    if value not in choices:
        raise ValueError(f"{field_name}={value!r} is unknown; choose one of {sorted(choices)}")
