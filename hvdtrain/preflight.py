"""Preflight: before step 0, every rank checks that it agrees with every other rank.

Ranks that disagree on versions, settings, the model's variables or the number of steps
hang in Horovod (a collective waits for a tensor that never comes) or, worse, train a
silently wrong model. One allgather of each rank's facts turns that into one error on
every rank, naming the ranks and the differing values.
"""
from __future__ import annotations

from hvdtrain._version import __version__
from hvdtrain.compat import variable_name
from hvdtrain.config import values
from hvdtrain.errors import RankError


class PreflightError(RankError):
    """The ranks disagree; raised identically on every rank."""


def facts(world, config, settings, model, steps: int, data) -> dict:
    """This rank's view of the run, flattened to comparable key -> value pairs."""
    import tensorflow as tf

    out = {"version.hvdtrain": __version__, "version.tensorflow": tf.__version__}
    out.update({f"version.{k}": v for k, v in world.versions().items()})
    # Settings that may differ per rank (paths, chattiness) are marked per_rank on the field.
    out.update({f"setting.{k}": v for k, v in values(config, per_rank=False).items()})
    out.update({f"setting.{k}": v for k, v in values(settings, per_rank=False).items()})
    out["model.variables"] = [(variable_name(v), tuple(v.shape),
                               str(getattr(v.dtype, "name", v.dtype))) for v in model.variables]
    # A tf.data pipeline's counts are agreed when it is counted (pipeline.py).
    out["data.train_examples"] = _examples(data.x_train)
    out["data.test_examples"] = 0 if data.x_test is None else _examples(data.x_test)
    out["steps_per_epoch"] = steps
    return out


def _examples(x):
    return "tf.data" if hasattr(x, "element_spec") else len(x)


def _describe(key, value):
    if key == "model.variables":
        return f"{len(value)} variables " + ", ".join(f"{n} {list(s)} {d}" for n, s, d in value)
    return repr(value)


def _first_difference(key, values):
    """For the variable list, show the first variable that differs rather than all of them."""
    if key != "model.variables":
        return key, values
    for i in range(max(len(v) for v in values)):
        column = [v[i] if i < len(v) else None for v in values]
        if len(set(column)) > 1:
            return f"model variable {i}", [("missing" if c is None else
                                            f"{c[0]} {list(c[1])} {c[2]}") for c in column]
    return key, values


def check(world, mine: dict) -> None:
    """Raise PreflightError on every rank if any rank's facts differ from another's."""
    everyone = world.allgather_object(mine)
    problems = []
    for key in sorted(set().union(*everyone)):
        values = [f.get(key) for f in everyone]
        if all(v == values[0] for v in values):
            continue
        label, shown = _first_difference(key, values)
        groups = {}
        for rank, value in enumerate(shown):
            groups.setdefault(value if isinstance(value, str) else _describe(key, value),
                              []).append(rank)
        parts = [f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {v}"
                 for v, r in groups.items()]
        problems.append(f"{label} differs ({'; '.join(parts)})")
    if problems:
        raise PreflightError("ranks disagree before step 0: " + " | ".join(problems))
