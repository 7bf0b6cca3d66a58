"""The models case: the models users train, through every path, side by side.

    models(out, names, size, batches, steps, epochs, repeats)   # 2 processes against 1
    alone(out, names, size, batches, steps, epochs, repeats)    # 1 process: Keras 3, tf_keras

A ResNet-50, a BERT-small-like encoder with a 30,522-word Embedding (sparse gradients) and a
wide MLP (151 MB of gradients), on synthetic data, each at one per-rank batch and seed through:
one process (the np-1 reference), hvdtrain's Task path and ``hk.fit``, Horovod's Keras fit
(its defaults, and tuned), Horovod's GradientTape loop, and MultiWorkerMirroredStrategy; the
processes are ``model_workers``. Launches go round-robin ``repeats`` times (a burst of load
from elsewhere hits every variant alike); each variant's samples/s is the median of its
launches, with the least and the most beside it. Then one launch each of the Task path and the
tape loop under HOROVOD_TIMELINE splits their step into compute, communication not hidden
behind it, and the rest (``step_split``; at the smoke level, the round's own launches of
those two run under it instead). Each round's launches make one pair per hvdtrain path
and Horovod reference (``paired``): the ratio of the two, per round, so that the load a round
saw cancels out of its ratio.

``alone``: the same models in one process with no launcher, hvdtrain's Task path and
``hk.fit`` against a plain Keras fit tuned as a user would tune it alone, under Keras 3 and
under tf_keras (TF_USE_LEGACY_KERAS=1), round-robin and paired the same way.
"""

from __future__ import annotations

import collections
import json
import os
import statistics

import numpy as np

from hvdtrain import bench
from hvdtrain.bench import progress
from hvdtrain.bench.cases import _DTYPE_BYTES, CONTROLLER, NP, _load, _mwms, _steady, read_timeline

MODEL_WORKERS = "hvdtrain.bench.model_workers"
VARIANTS = {  # name: label (every variant but "one" runs NP processes)
    "one": "1 process, 1 thread, no Horovod (np 1)",
    "task": "hvdtrain Task path",
    "hk_fit": "hvdtrain hk.fit",
    "hvd_fit": "Horovod Keras fit, its defaults",
    "hvd_fit_tuned": "Horovod Keras fit, tuned",
    "tape": "Horovod GradientTape loop",
    "mwms": "MultiWorkerMirroredStrategy",
}
# hvd_fit_tuned's fusion buffer: 256 MiB holds every gradient of the largest model (151 MB),
# so one cycle carries a whole step (Horovod's 128 MiB default splits the MLP's in two).
TUNED_ENV = {"HOROVOD_FUSION_THRESHOLD": str(256 << 20)}
# The np-1 comparison's variants: one process each, no launcher.
ALONE = {
    "fit": "plain Keras fit, one process, tuned (steps_per_execution 4)",
    "task": "hvdtrain Task path, one process",
    "hk_fit": "hvdtrain hk.fit, one process",
}
KERASES = {"k3": "Keras 3", "k2": "tf_keras (Keras 2)"}
# The acceptance's pairs: hvdtrain's paths against Horovod's best Keras fit (its defaults or
# tuned, whichever the round found faster) and its GradientTape benchmark.
HOROVOD_REFERENCES = ("hvd_fit_best", "tape")
# The paths whose step is split from a timeline: hvdtrain's (one grouped allreduce after the
# backward pass) and Horovod's tape (an allreduce per gradient as it is ready: overlap).
TIMELINE_VARIANTS = ("task", "tape")


def _launch(
    out, variant, name, size, batch, steps, epochs, extra_env=None, tag="", keras="k3", ranks=NP
):
    """One launch of ``variant`` on model ``name`` (``ranks`` processes: "one" always runs
    alone), under ``keras``; returns its worker's JSON."""
    path = os.path.join(out, "raw", f"models-{name}-{variant}{tag}.json")
    flags = [
        "--model",
        name,
        "--size",
        size,
        "--batch",
        batch,
        "--steps",
        steps,
        "--epochs",
        epochs,
    ]
    env = bench.env(**dict(TUNED_ENV if variant == "hvd_fit_tuned" else {}, **(extra_env or {})))
    env.pop("TF_USE_LEGACY_KERAS", None)  # Keras 3 unless asked: the same model code
    if keras == "k2":
        env["TF_USE_LEGACY_KERAS"] = "1"
    if variant == "mwms":
        _mwms(path, batch, flags, env, worker=("mwms",), module=MODEL_WORKERS)
    else:
        cmd = bench.python(MODEL_WORKERS, variant, "--out", path, *flags)
        alone = variant == "one" or ranks == 1
        bench.run(cmd if alone else bench.horovodrun(ranks, CONTROLLER, cmd), env, timeout=900)
    return _load(path)


def paired(runs, pairs) -> dict:
    """{"a/b": (median, least, most)} of the per-round ratios ``runs[a][i] / runs[b][i]``."""
    out = {}
    for a, b in pairs:
        ratios = [x / y for x, y in zip(runs[a], runs[b]) if y]
        if ratios:
            out[f"{a}/{b}"] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def models(
    out,
    names,
    size,
    batches,
    steps,
    epochs,
    repeats,
    timeline=TIMELINE_VARIANTS,
    timeline_apart=True,
    variants=tuple(VARIANTS),
) -> dict:
    """samples/s per model and variant (median of ``repeats`` round-robin launches, with the
    least and the most), scaling efficiency against the one-process run, gradient bytes, and
    the timeline's step split of the ``timeline`` variants: from launches of their own after
    the rounds (``timeline_apart``: the timeline's writes stay out of the samples/s), or from
    the last round's launches of those variants (the smoke level's, whose numbers mean
    nothing: two launches fewer). ``variants``: the variants to launch, in ``VARIANTS``'
    order; "one" always runs (every other is measured against it)."""
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise bench.BenchError(f"models: unknown variants {sorted(unknown)}")
    variants = [v for v in VARIANTS if v == "one" or v in variants]
    timeline = [v for v in timeline if v in variants]
    rows = []
    for name in names:
        batch = batches[name]
        runs, record, traced = collections.defaultdict(list), {}, {}
        for round_ in range(repeats):
            for variant in variants:
                extra, tag = None, ""
                if not timeline_apart and variant in timeline and round_ == repeats - 1:
                    extra, tag = _timeline_env(out, name, variant), "-timeline"
                record = _launch(out, variant, name, size, batch, steps, epochs, extra, tag)
                runs[variant].append(_steady(record["epochs"]))
                if extra:
                    traced[variant] = (extra["HOROVOD_TIMELINE"], record)
                progress(f"models {name} {variant}: {runs[variant][-1]:,.1f} samples/s")
        # Horovod's best Keras fit, round by round: its defaults or tuned, the faster
        if "hvd_fit" in runs and "hvd_fit_tuned" in runs:
            runs["hvd_fit_best"] = [
                max(a, b) for a, b in zip(runs["hvd_fit"], runs["hvd_fit_tuned"])
            ]
        ratios = paired(
            runs,
            [
                (a, b)
                for a in ("task", "hk_fit")
                for b in HOROVOD_REFERENCES
                if a in runs and b in runs
            ],
        )
        runs = {v: r for v, r in runs.items() if v in VARIANTS}
        median = {v: statistics.median(r) for v, r in runs.items()}
        one_step = batch / median["one"]
        splits = {}
        for variant in timeline:
            if variant not in traced:
                extra = _timeline_env(out, name, variant)
                rec = _launch(out, variant, name, size, batch, steps, epochs, extra, "-timeline")
                traced[variant] = (extra["HOROVOD_TIMELINE"], rec)
            path, rec = traced[variant]
            step = NP * batch / _steady(rec["epochs"])
            splits[variant] = step_split(path, step, one_step)
        rows.append(
            {
                "model": name,
                "batch_per_rank": batch,
                "ranks": NP,
                "parameters": record["parameters"],
                "gradient_bytes": record["gradient_bytes"],
                "samples_per_sec": median,
                "spread": {v: (min(r), max(r)) for v, r in runs.items()},
                "all_runs": dict(runs),
                "paired": ratios,
                "efficiency": {v: median[v] / (NP * median["one"]) for v in median if v != "one"},
                "step_split": splits,
            }
        )
        progress(f"models {name}: " + ", ".join(f"{v} {s:,.1f}" for v, s in median.items()))
    return {
        "size": size,
        "steps": steps,
        "epochs": epochs,
        "repeats": repeats,
        "variants": {v: VARIANTS[v] for v in variants},
        "rows": rows,
    }


def _timeline_env(out, name, variant) -> dict:
    """HOROVOD_TIMELINE for a launch of ``variant`` on model ``name``: a file of its own, new."""
    path = os.path.join(out, f"timeline-{name}-{variant}.json")
    if os.path.exists(path):
        os.remove(path)
    return {"HOROVOD_TIMELINE": path}


def alone(out, names, size, batches, steps, epochs, repeats, kerases=tuple(KERASES)) -> dict:
    """One process, no launcher: samples/s of ``ALONE``'s variants per Keras and model
    (median, least, most of ``repeats`` round-robin launches) and the per-round ratios of
    hvdtrain's paths to the plain Keras fit."""
    rows = []
    for keras in kerases:
        for name in names:
            runs = collections.defaultdict(list)
            for _ in range(repeats):
                for variant in ALONE:
                    record = _launch(
                        out,
                        variant,
                        name,
                        size,
                        batches[name],
                        steps,
                        epochs,
                        tag=f"-alone-{keras}",
                        keras=keras,
                        ranks=1,
                    )
                    runs[variant].append(_steady(record["epochs"]))
                    progress(
                        f"models alone {KERASES[keras]} {name} {variant}: "
                        f"{runs[variant][-1]:,.1f} samples/s"
                    )
            rows.append(
                {
                    "keras": keras,
                    "model": name,
                    "batch": batches[name],
                    "keras_version": record["keras"],
                    "samples_per_sec": {v: statistics.median(r) for v, r in runs.items()},
                    "spread": {v: (min(r), max(r)) for v, r in runs.items()},
                    "all_runs": dict(runs),
                    "paired": paired(runs, [("task", "fit"), ("hk_fit", "fit")]),
                }
            )
    return {
        "size": size,
        "steps": steps,
        "epochs": epochs,
        "repeats": repeats,
        "variants": dict(ALONE),
        "kerases": {k: KERASES[k] for k in kerases},
        "rows": rows,
    }


def step_split(path, step_seconds, compute_seconds) -> dict:
    """A step of ``step_seconds`` split three ways: compute (``compute_seconds``, the
    one-process step at the same per-rank batch), communication not hidden (from rank 0's
    timeline: per step, from the moment the last gradient was ready on every rank, the end
    of its last NEGOTIATE_ phase, to the end of the last allreduce or allgather; the median
    over the steps after the first third) and the rest (what is left: waiting for the
    slower rank, the host's work, the cores shared by two ranks); and ``bytes``, what the
    step's collectives carried (median over the same steps: an allreduce's tensor, an
    allgather's rows of every rank), against the gradients' dense bytes the page states.

    The per-step tensors: the largest set negotiated equally often (the steps' gradients; the
    broadcasts at the start, the metric sums at epoch ends come at other counts), and those
    one count off whose negotiations each fall within a step (the timeline cut in the last)."""
    events = read_timeline(path)
    ready, done, start, size = (collections.defaultdict(list) for _ in range(4))
    open_at = {}
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "B":
            open_at.setdefault(key, []).append((e.get("name", ""), e["ts"]))
        elif e.get("ph") == "E" and open_at.get(key):
            name, ts = open_at[key].pop()
            if name.startswith("NEGOTIATE_") and name != "NEGOTIATE_BROADCAST":
                ready[e["pid"]].append(e["ts"])
            elif name in ("ALLREDUCE", "ALLGATHER"):
                start[e["pid"]].append(ts)
                done[e["pid"]].append(e["ts"])
                args = e.get("args", {})
                size[e["pid"]].append(
                    int(np.prod(json.loads(args["shape"]), dtype=np.int64))
                    * _DTYPE_BYTES[args["dtype"].lower()]
                    if "shape" in args
                    else 0
                )
    # The steps' tensors: the largest set of tensors negotiated equally often, give or take the
    # last step (a run's other collectives, its metric sums and agreement checks, come at other
    # counts). The timeline stops with the process, without its last writes: the last step's
    # negotiations may have ended for some tensors only, its reductions lack their ends. The
    # steps that every tensor was seen to finish count.
    counts = collections.Counter(len(v) for v in ready.values())
    if not counts:
        return {
            "step": step_seconds,
            "compute": compute_seconds,
            "not_hidden": 0.0,
            "rest": step_seconds - compute_seconds,
            "communication": 0.0,
            "tensors": 0,
            "steps": 0,
            "bytes": 0,
        }
    per_step = max(counts, key=lambda c: (counts[c], c))
    tensors = [p for p, v in ready.items() if len(v) == per_step and done[p]]
    # a tensor one count off is a step's, the last step cut, where each of its negotiations
    # ended within its step: after the step before ended negotiating, before the next began
    after = [max(ready[p][i] for p in tensors) for i in range(per_step)]
    before = [min(ready[p][i] for p in tensors) for i in range(per_step)]
    tensors += [
        p
        for p, v in ready.items()
        if len(v) in (per_step - 1, per_step + 1)
        and done[p]
        and all(
            (i == 0 or after[i - 1] < ts) and (i + 1 == per_step or ts < before[i + 1])
            for i, ts in enumerate(v[:per_step])
        )
    ]
    most = min(min(len(done[p]), len(ready[p]), per_step) for p in tensors)
    exposed, busy, carried = [], [], []
    for i in range(most // 3, most):
        carried.append(sum(size[p][i] for p in tensors if i < len(size[p])))
        last_ready = max(ready[p][i] for p in tensors)
        end = max(done[p][i] for p in tensors)
        exposed.append(max(0.0, (end - last_ready) / 1e6))
        busy.append((end - min(start[p][i] for p in tensors)) / 1e6)
    not_hidden = statistics.median(exposed) if exposed else 0.0
    return {
        "step": step_seconds,
        "compute": compute_seconds,
        "not_hidden": not_hidden,
        "rest": step_seconds - compute_seconds - not_hidden,
        "communication": statistics.median(busy) if busy else 0.0,
        "tensors": len(tensors),
        "steps": most,
        "bytes": int(statistics.median(carried)) if carried else 0,
    }


def _median_spread(row, variant) -> str:
    """A table cell: the variant's median samples/s and its least-most range."""
    least, most = row["spread"][variant]
    return f"{row['samples_per_sec'][variant]:,.1f} ({least:,.1f}-{most:,.1f})"


def section(m, table) -> str:
    """The models case's Markdown: samples/s with spread, efficiency, gradient bytes, and the
    step splits. ``table`` is report.table."""
    variants = list(m["variants"])
    text = (
        f"\n### Models users train, {NP} processes against 1 ({m['size']} sizes, synthetic "
        f"data): samples/s, median of {m['repeats']} round-robin launches (least-most), "
        f"epoch{'s 2-' if m['epochs'] > 2 else ' '}{m['epochs']} of {m['steps']} steps "
        "(the first traces)\n\n"
    )
    text += "".join(f"- {v}: {label}\n" for v, label in m["variants"].items()) + "\n"
    rows = []
    for r in m["rows"]:
        cells = [_median_spread(r, v) for v in variants]
        rows.append([r["model"], r["batch_per_rank"], f"{r['gradient_bytes'] / 1e6:,.1f}"] + cells)
    text += table(["model", "batch per rank", "gradient MB per step"] + variants, rows)
    text += (
        f"\nScaling efficiency: samples/s of {NP} processes / ({NP} x the one-process "
        "run at the same per-rank batch)\n\n"
    )
    text += table(
        ["model"] + variants[1:],
        [[r["model"]] + [r["efficiency"][v] for v in variants[1:]] for r in m["rows"]],
    )
    pairs = [
        (r["model"], pair, *(f"{x:.3g}" for x in got))
        for r in m["rows"]
        for pair, got in r.get("paired", {}).items()
    ]
    if pairs:
        text += (
            "\nhvdtrain against Horovod, paired by round: each round's samples/s ratio "
            "(hvd_fit_best: Horovod's Keras fit at its defaults or tuned, whichever that "
            "round found faster), median (least, most) over the rounds\n\n"
        )
        text += table(["model", "ratio", "median", "least", "most"], pairs)
    splits = [
        (
            r["model"],
            v,
            s["step"] * 1e3,
            s["compute"] * 1e3,
            s["not_hidden"] * 1e3,
            s["rest"] * 1e3,
            s["communication"] * 1e3,
            f"{s['bytes'] / 1e6:,.1f}" if "bytes" in s else None,
        )
        for r in m["rows"]
        for v, s in r["step_split"].items()
    ]
    if splits:
        text += (
            "\nOne step split, ms (a launch under HOROVOD_TIMELINE): compute = the "
            "one-process step; not hidden = from the last gradient ready on every rank "
            "to the last reduction's end; rest = step - compute - not hidden; "
            "communication = first reduction's start to last one's end; MB carried = "
            "the step's collectives' tensors (an allgather's: every rank's rows)\n\n"
        )
        text += table(
            [
                "model",
                "variant",
                "step",
                "compute",
                "not hidden",
                "rest",
                "communication",
                "MB carried",
            ],
            splits,
        )
    return text


def alone_section(a, table) -> str:
    """The np-1 comparison's Markdown: samples/s per Keras and model, and the paired ratios."""
    variants = list(a["variants"])
    text = (
        f"\n### Models users train, one process, no launcher ({a['size']} sizes): "
        f"samples/s, median of {a['repeats']} round-robin launches (least-most), and each "
        "round's ratio to the plain Keras fit\n\n"
    )
    text += "".join(f"- {v}: {label}\n" for v, label in a["variants"].items()) + "\n"
    rows = []
    for r in a["rows"]:
        cells = [_median_spread(r, v) for v in variants]
        ratios = [f"{got[0]:.3g} ({got[1]:.3g}-{got[2]:.3g})" for got in r["paired"].values()]
        rows.append([a["kerases"][r["keras"]], r["model"], r["batch"]] + cells + ratios)
    pairs = list(a["rows"][0]["paired"]) if a["rows"] else []
    return text + table(["Keras", "model", "batch"] + variants + pairs, rows)
