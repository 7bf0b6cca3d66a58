"""The benchmark cases of the Keras fit paths: each launches real processes side by side and
returns plain dicts.

    fit(...)         model.fit, 2 processes: hvdtrain.keras (Keras 3 and 2) vs Horovod's own
                     Keras wrapper + BroadcastGlobalVariablesCallback (Keras 2): samples/s
    keras_speed(...) hk.fit and the Task path against Keras' and Horovod's own fit
    pipeline(...)    hk.fit from TFRecord files through tf.data vs from arrays, and vs
                     MultiWorkerMirroredStrategy's fit on the same pipeline
"""

from __future__ import annotations

import collections
import os
import statistics

from hvdtrain import bench
from hvdtrain.bench import progress
from hvdtrain.bench.cases import CONTROLLER, NP, WORKERS, _load, _mwms, _steady, run_variant

# The data of the fit, keras_speed and pipeline cases (the others take it from their spec):
# the full Fashion-MNIST, or the bundled 4,000-digit sample for --smoke (python -m hvdtrain.bench).
DATASET = "fashion_mnist"


# --- the model.fit path ---------------------------------------------------------------------

FIT_VARIANTS = {  # name: (label, worker --impl, Keras 2?)
    "hk_k3": ("hvdtrain.keras fit, Keras 3", "hk", False),
    "hk_k2": ("hvdtrain.keras fit, Keras 2", "hk", True),
    "hvd_k2": ("Horovod's keras wrapper + broadcast callback, Keras 2", "hvd_keras", True),
    # Horovod's own under Keras 3 too (scripts/patches/python/): Keras 3 against Keras 3
    "hvd_k3": ("Horovod's keras wrapper + broadcast callback, Keras 3", "hvd_keras", False),
}


# What the fit-path figures count (issue 28: each says it; the bench's own Timer callback runs
# after hk.fit's, so hk.fit's epoch-end checkpoint falls inside its timed epoch).
FIT_COUNTS = (
    "counts: samples/s, the mean of epochs 2-N; no side validates; both sides "
    "write a checkpoint of the model and its optimizer at each epoch's end, inside "
    "the timed epoch (hk.fit its own; Horovod's fit a ModelCheckpoint on rank 0, as "
    "Horovod's examples do)"
)
KERAS_SPEED_COUNTS = (
    "counts: samples/s of the fastest epoch after the first, best of the "
    "launches; no side validates; hk.fit writes a checkpoint at each epoch's "
    "end, inside the timed epoch (the BN rows: also every bn_every steps), "
    "and so does Horovod's fit (a ModelCheckpoint on rank 0, as Horovod's "
    "examples do); the Task path's follows its timed epoch; Keras' "
    "one-process fit writes none. The paired rows: the same two fits in the "
    "same processes, epoch after epoch, the median of the epoch pairs' "
    "ratios after the first pair"
)
PIPELINE_COUNTS = (
    "counts: samples/s, the mean of epochs 2-N; no side validates; hk.fit "
    "writes a checkpoint at each epoch's end, inside the timed epoch; "
    "MultiWorkerMirroredStrategy's fit writes none"
)


def fit(out, batch, epochs, repeats, hidden_units=256, lr=0.05) -> dict:
    """Best-of-``repeats`` steady samples/s of model.fit on 2 processes, round-robin, on the
    full Fashion-MNIST (``DATASET``)."""
    runs = collections.defaultdict(list)
    for _ in range(repeats):
        for name, (label, impl, keras2) in FIT_VARIANTS.items():
            path = os.path.join(out, "raw", f"fit-{name}.json")
            env = bench.env(**({"TF_USE_LEGACY_KERAS": "1"} if keras2 else {}))
            if not keras2:
                env.pop("TF_USE_LEGACY_KERAS", None)
            bench.run(
                bench.horovodrun(
                    NP,
                    CONTROLLER,
                    bench.python(
                        WORKERS,
                        "fit",
                        "--impl",
                        impl,
                        "--model",
                        "mlp",
                        "--out",
                        path,
                        "--batch",
                        batch,
                        "--epochs",
                        epochs,
                        "--hidden-units",
                        hidden_units,
                        "--lr",
                        lr,
                        "--dataset",
                        DATASET,
                    ),
                ),
                env,
            )
            runs[name].append(_steady(_load(path)["epochs"]))
    best = {v: max(r) for v, r in runs.items()}
    ratios = {
        "hk_k3/hvd_k3": best["hk_k3"] / best["hvd_k3"],
        "hk_k3/hvd_k2": best["hk_k3"] / best["hvd_k2"],
        "hk_k2/hvd_k2": best["hk_k2"] / best["hvd_k2"],
    }
    progress(
        "fit: "
        + ", ".join(f"{v} {best[v]:,.0f}" for v in best)
        + " samples/s; "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
    )
    return {
        "batch_per_rank": batch,
        "ranks": NP,
        "epochs": epochs,
        "repeats": repeats,
        "hidden_units": hidden_units,
        "samples_per_sec": best,
        "all_runs": dict(runs),
        "ratios": ratios,
        "variants": {k: v[0] for k, v in FIT_VARIANTS.items()},
        "counts": FIT_COUNTS,
    }


# --- issue 17's speed targets: the Keras paths against Keras' and Horovod's own -----------


def _fastest(epochs):
    """samples/s of the fastest epoch but the first: these epochs last 0.05-0.5 s, so one
    burst of another process's work decides an epoch's time, and the least disturbed epoch is
    the one that measures the code."""
    return max(e["samples_per_sec"] for e in epochs[1:] or epochs)


def _paired_ratios(record) -> list:
    """A paired launch's ratios, one per epoch after the first: the seconds of Horovod's fit's
    epoch over those of the hk.fit epoch just before it (> 1: hk.fit the faster)."""
    return [
        b["seconds"] / a["seconds"]
        for a, b in zip(record["epochs"][1:], record["paired_epochs"][1:])
    ]


def keras_speed(
    out,
    global_batch,
    epochs,
    repeats,
    spes=(1, 64),
    kerases=("k2", "k3"),
    bn_units=1024,
    bn_every=100,
    pair_epochs=30,
) -> dict:
    """samples/s of the fastest epoch after the first, best of ``repeats`` launches, every
    launch round-robin, on the softmax at ``global_batch`` (SGD, lr 0.5, full Fashion-MNIST):

    - fit: ``hk.fit`` (tf_keras and Keras 3) against Horovod's tf_keras fit with
      ``hvd.DistributedOptimizer`` (the faster of its two inputs: a tf.data pipeline shuffling
      all examples, as Horovod's examples do, or each rank's shard as arrays), 2 processes,
      at each ``compile(steps_per_execution=)`` in ``spes``;
    - task1: ``python -m hvdtrain.mnist --steps-per-execution 64``, 1 process, against a
      one-process ``model.fit`` of the arrays at ``steps_per_execution=64``, both under each
      of ``kerases`` (k2: tf_keras, k3: Keras 3);
    - pair: the fit comparison in the same 2 processes (``workers fit --impl pair``, under
      each of ``kerases``, ``pair_epochs`` epochs): each of hk.fit's epochs followed by one of
      Horovod's own Keras fit (its ``DistributedOptimizer``, the rank's shard as arrays, a
      ModelCheckpoint on rank 0) of a second model, so that both meet the same moments of a
      shared machine; the ratio is the median over every epoch pair after the first of all
      launches (separate launches differ by more than the sides do:
      docs/performance/startup.md);
    - bn: ``hk.fit`` of the mlp with BatchNormalization (784-``bn_units``-BN-10, Keras 3, 2
      processes, a checkpoint every ``bn_every`` steps), its moving statistics synced
      (hvdtrain's way, the sync's own seconds timed) or not (the bench's knob).
    """
    softmax = {
        "label": "softmax",
        "model": "softmax",
        "hidden_units": 256,
        "lr": 0.5,
        "dataset": DATASET,
    }
    per_rank = global_batch // NP
    launches = {}  # name: (group, command for an output path or None: the Task path, Keras 2?)

    def worker(impl, batch, *flags):
        return lambda path: bench.python(
            WORKERS,
            "fit",
            "--impl",
            impl,
            "--out",
            path,
            "--batch",
            batch,
            "--epochs",
            epochs,
            "--dataset",
            DATASET,
            *flags,
        )

    soft = ("--model", "softmax", "--lr", softmax["lr"])
    for spe in spes:
        for name, impl, keras2, extra in (
            (f"hk_k2_spe{spe}", "hk", True, ()),
            (f"hvd_k2_spe{spe}", "hvd_keras", True, ("--input", "dataset")),
            (f"hvd_arrays_k2_spe{spe}", "hvd_keras", True, ("--input", "arrays")),
            (f"hk_k3_spe{spe}", "hk", False, ()),
        ):
            cmd = worker(impl, per_rank, "--spe", spe, *soft, *extra)
            launches[name] = (
                "fit",
                lambda p, c=cmd: bench.horovodrun(NP, CONTROLLER, c(p)),
                keras2,
            )
    for spe in spes:
        for tag in kerases:

            def cmd(path, spe=spe):
                return bench.horovodrun(
                    NP,
                    CONTROLLER,
                    bench.python(
                        WORKERS,
                        "fit",
                        "--impl",
                        "pair",
                        "--out",
                        path,
                        "--batch",
                        per_rank,
                        "--epochs",
                        pair_epochs,
                        "--dataset",
                        DATASET,
                        "--spe",
                        spe,
                        *soft,
                    ),
                )

            launches[f"pair_{tag}_spe{spe}"] = ("pair", cmd, tag == "k2")
    for tag in kerases:
        keras2 = tag == "k2"
        launches[f"task_{tag}"] = ("task1", None, keras2)
        launches[f"keras_{tag}"] = (
            "task1",
            worker("keras", global_batch, "--spe", 64, *soft),
            keras2,
        )
    for name, extra in (("bn_sync", ()), ("bn_nosync", ("--no-bn-sync",))):
        cmd = worker(
            "hk",
            per_rank,
            "--model",
            "mlp",
            "--bn",
            "--hidden-units",
            bn_units,
            "--lr",
            0.05,
            "--checkpoint-every",
            bn_every,
            *extra,
        )
        launches[name] = ("bn", lambda p, c=cmd: bench.horovodrun(NP, CONTROLLER, c(p)), False)
    work = os.path.join(out, "runs")
    runs, sync_share, paired = collections.defaultdict(list), [], collections.defaultdict(list)
    for _ in range(repeats):
        for name, (group, cmd, keras2) in launches.items():
            if cmd is None:  # the Task path, as the throughput case runs it
                records, _ = run_variant(
                    "b",
                    softmax,
                    global_batch,
                    epochs,
                    work,
                    {"TF_USE_LEGACY_KERAS": "1" if keras2 else "0"},
                    flags=("--steps-per-execution", 64),
                    tag=f"-{name}",
                )
            else:
                path = os.path.join(out, "raw", f"keras_speed-{name}.json")
                bench.run(cmd(path), bench.keras_env(keras2))
                record = _load(path)
                records = record["epochs"]
                if group == "pair":
                    paired[name] += _paired_ratios(record)
                if name == "bn_sync":  # the sync's own seconds against the training's
                    sync_share.append(
                        record["bn_sync"]["seconds"] / sum(e["seconds"] for e in records)
                    )
            runs[name].append(_fastest(records))
            progress(f"keras_speed {name}: {runs[name][-1]:,.0f} samples/s")
    best = {v: max(r) for v, r in runs.items()}
    ratios = {}
    for spe in spes:  # against the faster of Horovod's two inputs
        horovod = max(best[f"hvd_k2_spe{spe}"], best[f"hvd_arrays_k2_spe{spe}"])
        ratios[f"fit_k2_spe{spe}"] = best[f"hk_k2_spe{spe}"] / horovod
        ratios[f"fit_k3_spe{spe}"] = best[f"hk_k3_spe{spe}"] / horovod
    for name, values in paired.items():  # hk.fit / Horovod's fit, epoch by epoch
        ratios[name] = statistics.median(values)
    for tag in kerases:
        ratios[f"task1_{tag}"] = best[f"task_{tag}"] / best[f"keras_{tag}"]
    # What the sync costs, two ways: the seconds spent in it over the training's seconds,
    # timed in the synced run (the least of the repeats), and the step time with it against
    # without it, minus 1 (two launches' difference: as noisy as the machine).
    ratios["bn_sync_share"] = min(sync_share)
    ratios["bn_sync_cost"] = best["bn_nosync"] / best["bn_sync"] - 1
    progress("keras_speed: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return {
        "global_batch": global_batch,
        "ranks": NP,
        "epochs": epochs,
        "repeats": repeats,
        "spes": list(spes),
        "kerases": list(kerases),
        "bn_units": bn_units,
        "bn_every": bn_every,
        "pair_epochs": pair_epochs,
        "paired": dict(paired),
        "samples_per_sec": best,
        "all_runs": dict(runs),
        "ratios": ratios,
        "groups": {k: v[0] for k, v in launches.items()},
        "counts": KERAS_SPEED_COUNTS,
    }


# --- issue 18's targets: a tf.data pipeline from TFRecord files ----------------------------

PIPELINE_VARIANTS = {  # name: label
    "hk_arrays": "hk.fit, arrays in memory (hk.dataset)",
    "hk_tfrecord": "hk.fit, TFRecord files through tf.data",
    "mwms_tfrecord": "MultiWorkerMirroredStrategy model.fit, the same pipeline",
}


def pipeline(out, batch, epochs, repeats, files=8, hidden_units=256, lr=0.05) -> dict:
    """Best-of-``repeats`` steady samples/s of the mlp (784-``hidden_units``-10, SGD, tf_keras)
    on the full Fashion-MNIST, 2 processes, ``batch`` per rank, round-robin: ``hk.fit`` from
    arrays (``hk.dataset``), ``hk.fit`` from ``files`` TFRecord files of equal size through
    a user's tf.data pipeline (interleave, map, seeded shuffle, batch, prefetch; hvdtrain
    shards it by file), and MultiWorkerMirroredStrategy's ``model.fit`` on the same
    pipeline at the global batch (auto-sharded by file). The files are written once into
    ``out``. All three under tf_keras: Keras 3's fit under MultiWorkerMirroredStrategy
    fails here (its distributed batches reach the model as PerReplica values)."""
    data_dir = os.path.join(out, f"tfrecord-{DATASET}-{files}")
    if not os.path.isdir(data_dir):
        bench.run(
            bench.python(
                WORKERS,
                "tfrecords",
                "--files",
                files,
                "--dataset",
                DATASET,
                "--out",
                data_dir + ".tmp",
            ),
            bench.env(),
        )
        os.replace(data_dir + ".tmp", data_dir)
    common = (
        "--model",
        "mlp",
        "--epochs",
        epochs,
        "--hidden-units",
        hidden_units,
        "--lr",
        lr,
        "--dataset",
        DATASET,
    )
    env = bench.keras_env(True)
    runs = collections.defaultdict(list)
    for _ in range(repeats):
        for name in PIPELINE_VARIANTS:
            path = os.path.join(out, "raw", f"pipeline-{name}.json")
            if name == "mwms_tfrecord":
                records, _ = _mwms(
                    path,
                    batch,
                    list(common),
                    env,
                    worker=("fit", "--impl", "mwms", "--input", "tfrecord", "--data-dir", data_dir),
                )
            else:
                extra = (
                    ("--input", "tfrecord", "--data-dir", data_dir) if name == "hk_tfrecord" else ()
                )
                bench.run(
                    bench.horovodrun(
                        NP,
                        CONTROLLER,
                        bench.python(
                            WORKERS,
                            "fit",
                            "--impl",
                            "hk",
                            "--out",
                            path,
                            "--batch",
                            batch,
                            *common,
                            *extra,
                        ),
                    ),
                    env,
                )
                records = _load(path)["epochs"]
            runs[name].append(_steady(records))
            progress(f"pipeline {name}: {runs[name][-1]:,.0f} samples/s")
    best = {v: max(r) for v, r in runs.items()}
    ratios = {
        "tfrecord/arrays": best["hk_tfrecord"] / best["hk_arrays"],
        "hk/mwms": best["hk_tfrecord"] / best["mwms_tfrecord"],
    }
    progress("pipeline: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return {
        "batch_per_rank": batch,
        "ranks": NP,
        "epochs": epochs,
        "repeats": repeats,
        "files": files,
        "hidden_units": hidden_units,
        "samples_per_sec": best,
        "all_runs": dict(runs),
        "ratios": ratios,
        "variants": dict(PIPELINE_VARIANTS),
        "counts": PIPELINE_COUNTS,
    }
