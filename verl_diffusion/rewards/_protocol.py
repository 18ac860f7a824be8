"""Wire format of the GenEval reward-server protocol (the one Flow-GRPO-style pipelines talk to).

POST <url> with a pickled dict body::

    {"images": [JPEG bytes, ...], "meta_datas": [GenEval metadata dict, ...], "only_strict": bool}

200 reply: a pickled dict::

    {"scores": [float] (partial credit), "rewards": [float] (accuracy), "strict_rewards": [float],
     "group_rewards": {tag: [float]}, "group_strict_rewards": {tag: [float]}}   # -10.0 = not this tag

500 reply: the server's traceback as text.

Pickle is the deployed servers' format. Both ends here unpickle with ``safe_loads``, which only builds
plain containers and numbers (and numpy scalars / arrays), so a hostile peer cannot run code through it.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

# The group value a server puts for images whose tag is not this group.
NOT_IN_GROUP = -10.0

_ALLOWED = {
    ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "bytes"), ("builtins", "bytearray"), ("builtins", "str"),
    ("builtins", "int"), ("builtins", "float"), ("builtins", "bool"), ("builtins", "complex"),
    ("collections", "OrderedDict"), ("collections", "defaultdict"),
    ("numpy", "dtype"), ("numpy", "ndarray"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: only plain data is accepted")
        return super().find_class(module, name)


def safe_loads(data: bytes) -> Any:
    """Unpickle plain data only (dict, list, str, bytes, numbers, numpy scalars)."""
    return _SafeUnpickler(io.BytesIO(data)).load()


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=4)


RESPONSE_KEYS = ("scores", "rewards", "strict_rewards", "group_rewards", "group_strict_rewards")
