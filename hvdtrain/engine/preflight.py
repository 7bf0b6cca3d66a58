"""Preflight: before step 0, every rank checks that it agrees with every other rank.

Ranks that disagree on versions, settings, the model's variables or the number of steps
hang in Horovod (a collective waits for a tensor that never comes) or, worse, train a
silently wrong model. One allgather of each rank's facts turns that into one error on
every rank, naming the ranks and the differing values.
"""

from __future__ import annotations

from hvdtrain._version import __version__
from hvdtrain.base.compat import variable_name
from hvdtrain.base.compat import variables as compat_variables
from hvdtrain.base.config import values
from hvdtrain.base.errors import RankError


class PreflightError(RankError):
    """The ranks disagree; raised identically on every rank."""


# The way out when a layer's state outside its weights differs between the ranks.
ADAPT_HINT = (
    "adapt it on the same (whole) data on every rank, or with hk.adapt(layer, data) "
    "(hvdtrain.keras.adapt: rank 0 adapts, every rank gets its state)"
)


def layer_state(model) -> dict:
    """The state Keras keeps outside a model's weights, layer by layer: what each rank's own
    ``adapt`` decides and no weight broadcast reaches (TextVectorization's, StringLookup's and
    IntegerLookup's vocabularies; Normalization's mean and variance tensors; Discretization's
    bin boundaries; any array, tensor or list of floats a layer holds that is not a
    variable). {"layer 'name' what": "description with a digest"}; the same script on every
    rank gives the same keys, so a value that differs is state that differs."""
    import hashlib

    import numpy as np

    out, seen = {}, set()
    for i, layer in enumerate(_layers(model)):
        where = f"layer {layer.name!r}" if layer.name not in seen else f"layer {i} {layer.name!r}"
        seen.add(layer.name)
        vocabulary = _vocabulary(layer)
        if vocabulary is not None:
            text = "\n".join(map(str, vocabulary)).encode("utf-8", "backslashreplace")
            out[f"{where} vocabulary"] = (
                f"{len(vocabulary)} entries, sha256 {hashlib.sha256(text).hexdigest()[:12]}"
            )
        for name, value in sorted(state_attributes(layer).items()):
            a = np.asarray(value)
            data = a.tobytes() if a.dtype.kind != "O" else repr(a.tolist()).encode()
            out[f"{where} {name.lstrip('_')}"] = (
                f"{list(a.shape)} {a.dtype}, sha256 {hashlib.sha256(data).hexdigest()[:12]}"
            )
    return out


def _layers(model) -> list:
    """The model and every layer in it (Keras 2 lists helper trackables too: left out)."""
    flatten = getattr(model, "_flatten_layers", None)
    found = list(flatten(include_self=True, recursive=True)) if flatten else [model]
    return [layer for layer in found if isinstance(getattr(layer, "name", None), str)]


def _vocabulary(layer):
    get = getattr(layer, "get_vocabulary", None)
    if get is None:
        return None
    try:
        return list(get())
    except Exception:  # noqa: BLE001 (a layer that has none yet: nothing to compare)
        return None


def state_attributes(layer) -> dict:
    """A layer's own arrays, eager tensors and lists of floats that are not variables (the
    variables are weights, which rank 0 broadcasts): {attribute: value}."""
    import collections.abc
    import numbers

    import numpy as np

    found = {}
    for name, value in vars(layer).items():
        if hasattr(value, "assign") or name in ("_self_unconditional_checkpoint_dependencies",):
            continue  # a variable (a weight), or Keras' own bookkeeping
        if isinstance(value, np.ndarray) or (type(value).__name__ == "EagerTensor"):
            found[name] = value
        elif (
            isinstance(value, collections.abc.Sequence)
            and not isinstance(value, (str, bytes))
            and len(value)
            and all(
                isinstance(v, numbers.Real) and not isinstance(v, (bool, int, np.integer))
                for v in value
            )
        ):
            found[name] = [float(v) for v in value]
    return found


def model_facts(model) -> dict:
    """The model's fingerprint: its variables' names, shapes and dtypes, and its layers'
    state outside the weights (``layer_state``)."""
    return {
        "model.variables": [
            (variable_name(v), tuple(v.shape), str(getattr(v.dtype, "name", v.dtype)))
            for v in compat_variables(model.variables)
        ],
        **layer_state(model),
    }


def check_model(world, model) -> None:
    """All ranks, before the first broadcast: the ranks' models are the same model (a
    difference would break the broadcast with Horovod's shape error, or train silently wrong
    with per-rank vocabularies)."""
    if world.size > 1:
        check(world, model_facts(model))


def facts(world, config, settings, model, steps: int, data) -> dict:
    """This rank's view of the run, flattened to comparable key -> value pairs."""
    import tensorflow as tf

    out = {"version.hvdtrain": __version__, "version.tensorflow": tf.__version__}
    out.update({f"version.{k}": v for k, v in world.versions().items()})
    # Settings that may differ per rank (paths, chattiness) are marked per_rank on the field.
    out.update({f"setting.{k}": v for k, v in values(config, per_rank=False).items()})
    out.update({f"setting.{k}": v for k, v in values(settings, per_rank=False).items()})
    out.update(model_facts(model))
    # A tf.data pipeline's counts are agreed when it is counted (hvdtrain.inputs.sharding).
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
            return f"model variable {i}", [
                ("missing" if c is None else f"{c[0]} {list(c[1])} {c[2]}") for c in column
            ]
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
        groups: dict[str, list[int]] = {}
        for rank, value in enumerate(shown):
            groups.setdefault(
                value if isinstance(value, str) else _describe(key, value), []
            ).append(rank)
        parts = [
            f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {v}"
            for v, r in groups.items()
        ]
        problems.append(f"{label} differs ({'; '.join(parts)})")
    if problems:
        hint = any(
            key.startswith("layer ")
            for key in sorted(set().union(*everyone))
            if len({str(f.get(key)) for f in everyone}) > 1
        )
        raise PreflightError(
            "ranks disagree before step 0: "
            + " | ".join(problems)
            + (f": {ADAPT_HINT}" if hint else "")
        )
