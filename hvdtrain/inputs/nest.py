"""The inputs ``model.fit`` takes besides arrays: dicts (by input or output name), tuples and
lists of arrays, nested. hk.dataset and hk.fit's validation data hold, shard and batch them
leaf by leaf; every leaf holds the same examples along its first axis.

A list of numbers (``[[0, 1], [1, 0]]``) is one array, as numpy reads it: a list or tuple is
a structure only when its items are arrays (or structures) themselves, as Keras reads a list
of inputs.
"""

from __future__ import annotations

import numpy as np

from hvdtrain.base.errors import DataError


def is_structure(x) -> bool:
    if isinstance(x, dict):
        return True
    return (
        isinstance(x, (tuple, list))
        and len(x) > 0
        and all(
            isinstance(i, (dict, tuple, list)) and is_structure(i) or hasattr(i, "shape") for i in x
        )
    )


def map(fn, x):  # the structure's map, as tf.nest.map_structure
    """``fn`` on every leaf of ``x``, the structure kept (dict keys, tuple or list)."""
    if isinstance(x, dict):
        return {k: map(fn, v) for k, v in x.items()}
    if is_structure(x):
        return (
            type(x)(map(fn, v) for v in x) if isinstance(x, list) else tuple(map(fn, v) for v in x)
        )
    return fn(x)


def leaves(x, path: str = "") -> list:
    """[(path, leaf)], the path as a user would index it: ``["image"]``, ``[0]``."""
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in leaves(v, f"{path}[{k!r}]")]
    if is_structure(x):
        return [p for i, v in enumerate(x) for p in leaves(v, f"{path}[{i}]")]
    return [(path, x)]


def arrays(x):
    """``x`` with every leaf a numpy array."""
    return map(np.asarray, x)


def take(x, index):
    """The examples ``index`` (a slice or integer array) of every leaf."""
    return map(lambda a: np.asarray(a)[index], x)


def shapes(x) -> dict:
    """{path: an example's shape} of every leaf."""
    return {p: tuple(np.shape(a)[1:]) for p, a in leaves(x)}


def examples(what: str, parts) -> int:
    """The number of examples every leaf of ``parts`` ((name, structure) pairs) holds; a
    leaf with no first axis or another count is one line naming it."""
    counts = []
    for name, x in parts:
        for path, a in leaves(x):
            if np.ndim(a) == 0:
                raise DataError(f"{what}: {name}{path} is a single value, not an array of examples")
            counts.append((f"{name}{path}", len(a)))
    first = counts[0]
    for other in counts[1:]:
        if other[1] != first[1]:
            raise DataError(
                f"{what}: {first[0]} has {first[1]} examples but {other[0]} has {other[1]}"
            )
    return first[1]
