"""The benchmark cases: each launches real processes side by side and returns plain dicts.

    allreduce(...)   hvd.allreduce (MPI and Gloo controllers), mpi4py Allreduce, numpy copy
    throughput(...)  (a) plain TF, (b) hvdtrain 1 process (and 1 thread), (c) hvdtrain 2
                     processes, (d) MultiWorkerMirroredStrategy 2 workers: samples/s
    tta(...)         seconds of training to a test accuracy, and the process wall time of the
                     same job: hvdtrain 1 and 2 processes, MWMS 2 workers, plain Keras
    steps_per_call(...)  hvdtrain at several --steps-per-execution values, 1 and 2 processes
    timeline(...)    one hvdtrain run under HOROVOD_TIMELINE, summarised per activity
    fit(...)         model.fit, 2 processes: hvdtrain.keras (Keras 3 and 2) vs Horovod's own
                     Keras wrapper + BroadcastGlobalVariablesCallback (Keras 2): samples/s
    keras_speed(...) issue 17's targets: hk.fit, the Task path against Keras' and Horovod's own
    pipeline(...)    issue 18's targets: hk.fit from TFRecord files through tf.data vs from
                     arrays, and vs MultiWorkerMirroredStrategy's fit on the same pipeline
"""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import statistics

import numpy as np

from hvdtrain.tools import bench
from hvdtrain.tools.bench import BenchError, progress

WORKERS = "hvdtrain.tools.bench.workers"
NP = 2  # processes of the distributed variants (this machine has 2 cores)
CONTROLLER = "mpi"  # horovodrun's controller for (c); see docs/performance/reproduce.md


def _load(path):
    with open(path) as f:
        return json.load(f)


# --- allreduce ------------------------------------------------------------------------------

# The malloc environment of every allreduce series. numpy madvises its arrays of 4 MiB and more
# into transparent huge pages; TensorFlow's allocator (glibc malloc) does not, and Open MPI's
# shared-memory transport copies a 4 KiB-page buffer 1.3-1.6x slower (mpi4py on 4 KiB pages:
# 0.57/3.8/33 ms vs 0.36/2.3/26 ms at 4/16/64 MiB). Open MPI also mallocs, maps and unmaps a
# 32 MiB temporary per 64 MiB allreduce (8,192 page faults per call, in both hvd and mpi4py).
# glibc.malloc.hugetlb=1 gives every series the same huge-page memory (glibc >= 2.35; older
# glibc ignores it), so the series differ only in the library under test.
ALLREDUCE_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
# The data of the fit, keras_speed and pipeline cases (the others take it from their spec):
# the full Fashion-MNIST, or the bundled 4,000-digit sample for --smoke (python -m hvdtrain.bench).
DATASET = "fashion_mnist"


def allreduce(out: str, sizes, scale: float = 1.0) -> dict:
    """Latency, algbw and busbw per size for each implementation.

    Launches go round-robin (memcpy, hvd_mpi, hvd_gloo, mpi4py, ..., then again) and each
    series keeps, per size, its best launch; each launch keeps its best timed round. The full
    suite (scale >= 1) runs 2 repeats and adds hvd_mpi_graph (the allreduce inside a
    tf.function, as a training step calls it) and hvd_mpi_4k (hvd_mpi without the huge-page
    environment: what a run launched without it gets).
    """
    flags = ["--sizes", ",".join(map(str, sizes)), "--scale", scale]
    hvd = lambda controller, f, *extra: bench.horovodrun(NP, controller, bench.python(  # noqa
        WORKERS, "allreduce", "--impl", "hvd", "--out", f, *flags, *extra))
    launches = {  # name: (command for an output path, extra environment)
        "memcpy": (lambda f: bench.python(WORKERS, "memcpy", "--out", f, *flags), ALLREDUCE_ENV),
        "hvd_mpi": (lambda f: hvd("mpi", f), ALLREDUCE_ENV),
        "hvd_gloo": (lambda f: hvd("gloo", f), ALLREDUCE_ENV),
        # the Open MPI setting hvdtrain gives Horovod's ranks on a full machine (distributed.
        # _horovod_defaults): no effect on a quiet machine, fewer stolen slices on a busy one
        "mpi4py": (lambda f: bench.mpirun(NP, bench.python(
            WORKERS, "allreduce", "--impl", "mpi4py", "--out", f, *flags)),
            dict(ALLREDUCE_ENV, OMPI_MCA_mpi_yield_when_idle="1")),
    }
    repeats = 1
    if scale >= 1:
        repeats = 2
        launches["hvd_mpi_graph"] = (lambda f: hvd("mpi", f, "--mode", "graph"), ALLREDUCE_ENV)
        launches["hvd_mpi_4k"] = (lambda f: hvd("mpi", f), {})
    best, ranks = {}, {}
    for _ in range(repeats):
        for name, (cmd, extra) in launches.items():
            path = os.path.join(out, "raw", f"allreduce-{name}.json")
            environ = bench.env(**extra)
            if not extra:
                environ.pop("GLIBC_TUNABLES", None)
            wall = bench.run(cmd(path), environ, timeout=300)
            data = _load(path)
            ranks[name] = data["ranks"]
            for row in data["rows"]:
                kept = best.setdefault(name, {}).get(row["bytes"])
                if kept is None or row["seconds"] < kept["seconds"]:
                    best[name][row["bytes"]] = row
            big = data["rows"][-1]
            progress(f"allreduce {name:13s} {big['bytes'] >> 20} MiB: {big['seconds'] * 1e3:.2f} "
                     f"ms ({wall:.0f}s)")
    series = {}
    for name in launches:
        rows = [best[name][b] for b in sorted(best[name])]
        for row in rows:
            row["algbw"] = bench.algbw(row["bytes"], row["seconds"])
            row["busbw"] = (bench.busbw(row["bytes"], row["seconds"], ranks[name])
                            if name != "memcpy" else row["algbw"])
        series[name] = rows
    big = {n: s[-1] for n, s in series.items()}
    progress(f"allreduce {big['mpi4py']['bytes'] >> 20} MiB busbw: " + ", ".join(
        f"{n} {r['busbw'] / 1e9:.2f}" for n, r in big.items()) + " GB/s")
    return {"ranks": NP, "sizes": list(sizes), "series": series, "repeats": repeats,
            "environment": ALLREDUCE_ENV}


# --- training throughput -------------------------------------------------------------------

def _hvdtrain_flags(spec, batch, run_dir, epochs, np_):
    return ["--dataset", spec["dataset"], "--model", spec["model"], "--hidden-units",
            spec["hidden_units"], "--learning-rate", spec["lr"], "--batch-size", batch,
            "--epochs", epochs, "--num-workers", np_, "--checkpoint-every", 0,
            "--keep-checkpoints", 1000, "--verbose", 0, "--run-dir", run_dir,
            *(["--no-download"] if spec["dataset"] == "mnist" else [])]  # the bundled sample


def _steady(epochs):
    """samples/s over every epoch but the first (which includes tracing and warm-up)."""
    rest = epochs[1:] or epochs
    samples = sum(e["samples_per_sec"] * e["seconds"] for e in rest)
    return samples / sum(e["seconds"] for e in rest)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_variant(variant, spec, global_batch, epochs, work, extra_env=None, flags=(), tag=""):
    """Launch one variant (hvdtrain's with extra ``flags``); return (its per-epoch records,
    wall seconds)."""
    name = f"{spec['model']}-{global_batch}-{variant}{tag}"
    run_dir = os.path.join(work, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    env = bench.env(**(extra_env or {}))
    worker_flags = ["--dataset", spec["dataset"], "--model", spec["model"], "--hidden-units",
                    spec["hidden_units"], "--lr", spec["lr"], "--epochs", epochs]
    out = os.path.join(run_dir, "out.json")
    if variant == "a":
        wall = bench.run(bench.python(WORKERS, "plain", "--out", out, "--batch", global_batch,
                                      *worker_flags), env)
        return _load(out)["epochs"], wall
    if variant == "d":
        return _mwms(out, global_batch // NP, worker_flags, env)
    np_ = NP if variant == "c" else 1
    per_rank = {"b_rank": global_batch // NP}.get(variant, global_batch // np_)
    if variant == "b1":
        env.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    cmd = bench.python("hvdtrain.mnist", *_hvdtrain_flags(spec, per_rank, run_dir, epochs, np_),
                       *flags)
    wall = bench.run(bench.horovodrun(NP, CONTROLLER, cmd) if np_ > 1 else cmd, env)
    return _metrics(run_dir), wall


def _mwms(out, per_worker, worker_flags, env, target=0.0, worker=("mwms",)):
    ports = bench.free_ports(NP)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    import subprocess
    import time
    tick = time.perf_counter()
    for index in range(NP):
        e = dict(env, TF_CONFIG=json.dumps({"cluster": cluster,
                                            "task": {"type": "worker", "index": index}}))
        cmd = bench.python(WORKERS, *worker, "--index", index, "--out", out, "--batch",
                           per_worker, "--target", target, *worker_flags)
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    errors = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, 9)
            raise BenchError("MultiWorkerMirroredStrategy workers timed out") from None
        if proc.returncode:
            errors.append(err.strip().splitlines()[-5:])
    if errors:
        raise BenchError(f"MultiWorkerMirroredStrategy worker failed: {errors}")
    return _load(out)["epochs"], time.perf_counter() - tick


VARIANTS = {"a": "plain TF, 1 process", "b": "hvdtrain, 1 process",
            "b1": "hvdtrain, 1 process, 1 thread", "c": "hvdtrain, 2 processes",
            "d": "MultiWorkerMirrored, 2 workers",
            "b_rank": "hvdtrain, 1 process, batch of one rank of (c)"}


def throughput(out, specs, batches, epochs, repeats) -> dict:
    """Best-of-``repeats`` steady samples/s per (model, global batch, variant).

    Repeats run round-robin (a, b, b1, c, d, a, b, ...) so that a burst of load from
    elsewhere hits every variant alike; the best run of each is the least disturbed one.
    """
    work = os.path.join(out, "runs")
    rows = []
    for spec in specs:
        variants = ["a", "b", "b1", "c", "d"] + (["b_rank"] if spec["model"] == "softmax" else [])
        for batch in batches:
            runs = collections.defaultdict(list)
            for _ in range(repeats):
                for v in variants:
                    records, wall = run_variant(v, spec, batch, epochs, work)
                    runs[v].append(_steady(records))
            best = {v: max(r) for v, r in runs.items()}
            per_rank = {v: batch // (NP if v in ("c", "d", "b_rank") else 1) for v in variants}
            rows.append({"model": spec["label"], "global_batch": batch, "samples_per_sec": best,
                         "all_runs": dict(runs),
                         "step_ms": {v: 1e3 * (batch if v != "b_rank" else batch // NP) / best[v]
                                     for v in variants}, "per_rank_batch": per_rank})
            progress(f"throughput {spec['label']} batch {batch}: " + ", ".join(
                f"{v} {best[v]:,.0f}" for v in variants) + " samples/s")
    return {"epochs": epochs, "repeats": repeats, "rows": rows, "variants": VARIANTS}


# --- steps per compiled call ---------------------------------------------------------------

def steps_per_call(out, specs, global_batch, epochs, values, repeats) -> dict:
    """Best-of-``repeats`` steady samples/s of hvdtrain, 1 process (b) and 2 processes (c),
    at each ``--steps-per-execution`` (0: auto), round-robin."""
    work = os.path.join(out, "runs")
    rows = []
    for spec in specs:
        for variant in ("b", "c"):
            runs = collections.defaultdict(list)
            for _ in range(repeats):
                for k in values:
                    records, _ = run_variant(variant, spec, global_batch, epochs, work,
                                             flags=("--steps-per-execution", k), tag=f"-spe{k}")
                    runs[k].append(_steady(records))
            best = {k: max(r) for k, r in runs.items()}
            rows.append({"model": spec["label"], "variant": variant, "samples_per_sec": best})
            progress(f"steps per call {spec['label']} ({variant}): " + ", ".join(
                f"{k or 'auto'} {v:,.0f}" for k, v in best.items()) + " samples/s")
    return {"global_batch": global_batch, "epochs": epochs, "repeats": repeats,
            "values": list(values), "rows": rows}


# --- time to accuracy ----------------------------------------------------------------------

def _accuracy_per_epoch(run_dir, data):
    """Test accuracy of every epoch-end checkpoint (numpy forward pass, outside the timing)."""
    from hvdtrain.engine import checkpoint
    x = data.x_test.reshape(-1, 784).astype(np.float32) / 255.0
    found = {}
    for _, path in checkpoint.list_checkpoints(os.path.join(run_dir, "checkpoints")):
        meta, arrays = checkpoint.read(path)
        if meta["offset"]:
            continue
        h = x
        for i in range(0, len(arrays) - 2, 2):  # Dense layers: kernel, bias (optimizer after)
            if arrays[i].ndim != 2:
                break
            h = h @ arrays[i] + arrays[i + 1]
            if arrays[i].shape[1] != 10:
                h = np.maximum(h, 0)
        found[meta["epoch"]] = float(np.mean(h.argmax(-1) == data.y_test))
    return found


TTA_VARIANTS = {  # variant: (label, what its process does besides the epochs)
    "b": ("hvdtrain, 1 process", "python -m hvdtrain.mnist: a checkpoint at each epoch's end "
          "(scored afterwards, outside the process), the test set at the end, model.keras, "
          "result.json"),
    "c": ("hvdtrain, 2 processes", "the same under horovodrun -np 2 --mpi"),
    "d": ("MWMS, 2 workers", "MultiWorkerMirroredStrategy, a tf.function step: the test set "
          "scored after each epoch (untimed)"),
    "k": ("plain Keras, 1 process", "model.fit of the arrays (Keras' defaults: "
          "steps_per_execution 1, shuffled): the test set scored after each epoch (untimed)"),
}


def tta(out, spec, global_batch, target, max_epochs) -> dict:
    """Training seconds until the test accuracy reaches ``target`` (evaluation not counted),
    and each variant's process wall time for the same job: ``max_epochs`` epochs and the test
    set scored (every variant trains them all, whatever epoch reaches the target)."""
    from hvdtrain.inputs.data import load_mnist_format
    from hvdtrain.distributed import World
    data = load_mnist_format(spec["dataset"], None, False, World(), notice=lambda m: None)
    work = os.path.join(out, "runs")
    os.makedirs(work, exist_ok=True)
    result = {"target": target, "global_batch": global_batch, "model": spec["label"],
              "lr": spec["lr"], "max_epochs": max_epochs, "rows": {}}
    flags = ["--dataset", spec["dataset"], "--model", spec["model"], "--hidden-units",
             spec["hidden_units"], "--lr", spec["lr"], "--epochs", max_epochs]
    for variant, (label, does) in TTA_VARIANTS.items():
        timings = None
        if variant == "d":
            records, wall = _mwms(os.path.join(work, "tta-d.json"), global_batch // NP,
                                  flags + ["--test-accuracy"], bench.env())
            accuracy = {r["epoch"]: r["test_accuracy"] for r in records}
        elif variant == "k":
            path = os.path.join(work, "tta-k.json")
            wall = bench.run(bench.python(WORKERS, "fit", "--impl", "keras", "--out", path,
                                          "--batch", global_batch, "--test-accuracy", *flags),
                             _keras_env(False))
            records = _load(path)["epochs"]
            accuracy = {r["epoch"]: r["test_accuracy"] for r in records}
        else:
            records, wall = run_variant(variant, spec, global_batch, max_epochs, work)
            run_dir = os.path.join(work, f"{spec['model']}-{global_batch}-{variant}")
            accuracy = _accuracy_per_epoch(run_dir, data)
            timings = _load(os.path.join(run_dir, "result.json")).get("timings")
        reached = next((e for e in sorted(accuracy) if accuracy[e] >= target), None)
        seconds = (sum(r["seconds"] for r in records if r["epoch"] <= reached)
                   if reached else None)
        result["rows"][variant] = {
            "label": label, "does": does, "epochs": reached, "seconds": seconds,
            "accuracy": accuracy, "wall": wall, "epochs_run": len(records),
            "train_seconds": sum(r["seconds"] for r in records), "timings": timings}
        progress(f"time to accuracy {target:.2f}, {label}: "
                 + (f"{seconds:.2f} s ({reached} epochs)" if reached else "not reached")
                 + f"; process wall {wall:.1f} s for {len(records)} epochs")
    rows = result["rows"]
    result["wall_ratios"] = {"c/d": rows["c"]["wall"] / rows["d"]["wall"],
                             "b/k": rows["b"]["wall"] / rows["k"]["wall"]}
    return result


# --- where the time goes ------------------------------------------------------------------

def timeline(out, spec, global_batch, epochs) -> dict:
    """Run (c) once under HOROVOD_TIMELINE; total time per activity (B/E pairs) per rank 0."""
    path = os.path.join(out, "timeline.json")
    records, _ = run_variant("c", spec, global_batch, epochs, os.path.join(out, "runs"),
                             {"HOROVOD_TIMELINE": path})
    return {"path": path, "model": spec["label"], "global_batch": global_batch,
            "steps": records[-1]["global_step"], "epochs": epochs, **summarize_timeline(path)}


def read_timeline(path) -> list:
    """The events of a Horovod timeline (a JSON array that Horovod may leave unterminated)."""
    with open(path) as f:
        text = f.read().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def summarize_timeline(path) -> dict:
    """Seconds and counts per activity name over all tensors, from a Horovod (Chrome trace)
    timeline; ``allreduce_rounds``: the allreduce negotiation rounds, a grouped allreduce's
    tensors (named ``..._KofN``) counting once; ``training_rounds``: those from the first
    grouped round (the first step's) to the last, inclusive: the steps' and what runs between
    them, without the run's start and end (its agreement questions, the final scoring)."""
    events = read_timeline(path)
    tensors = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"
               and "name" in e.get("args", {})}
    open_at, totals, counts = {}, collections.Counter(), collections.Counter()
    rounds, grouped_at = 0, []  # the round numbers of grouped rounds
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "B":
            open_at.setdefault(key, []).append((e.get("name"), e["ts"]))
            group = re.search(r"_(\d+)of\d+$", tensors.get(e.get("pid"), ""))
            if e.get("name") == "NEGOTIATE_ALLREDUCE" and (not group or group.group(1) == "1"):
                rounds += 1
                if group:
                    grouped_at.append(rounds)
        elif e.get("ph") == "E" and open_at.get(key):
            name, ts = open_at[key].pop()
            totals[name] += (e["ts"] - ts) / 1e6
            counts[name] += 1
    return {"seconds": dict(totals.most_common()), "counts": dict(counts),
            "allreduce_rounds": rounds,
            "training_rounds": grouped_at[-1] - grouped_at[0] + 1 if grouped_at else 0}


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
FIT_COUNTS = ("counts: samples/s, the mean of epochs 2-N; no side validates; both sides "
              "write a checkpoint of the model and its optimizer at each epoch's end, inside "
              "the timed epoch (hk.fit its own; Horovod's fit a ModelCheckpoint on rank 0, as "
              "Horovod's examples do)")
KERAS_SPEED_COUNTS = ("counts: samples/s of the fastest epoch after the first, best of the "
                      "launches; no side validates; hk.fit writes a checkpoint at each epoch's "
                      "end, inside the timed epoch (the BN rows: also every bn_every steps), "
                      "and so does Horovod's fit (a ModelCheckpoint on rank 0, as Horovod's "
                      "examples do); the Task path's follows its timed epoch; Keras' "
                      "one-process fit writes none. The paired rows: the same two fits in the "
                      "same processes, epoch after epoch, the median of the epoch pairs' "
                      "ratios after the first pair")
PIPELINE_COUNTS = ("counts: samples/s, the mean of epochs 2-N; no side validates; hk.fit "
                   "writes a checkpoint at each epoch's end, inside the timed epoch; "
                   "MultiWorkerMirroredStrategy's fit writes none")


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
            bench.run(bench.horovodrun(NP, CONTROLLER, bench.python(
                WORKERS, "fit", "--impl", impl, "--model", "mlp", "--out", path, "--batch",
                batch, "--epochs", epochs, "--hidden-units", hidden_units, "--lr", lr,
                "--dataset", DATASET)), env)
            runs[name].append(_steady(_load(path)["epochs"]))
    best = {v: max(r) for v, r in runs.items()}
    ratios = {"hk_k3/hvd_k3": best["hk_k3"] / best["hvd_k3"],
              "hk_k3/hvd_k2": best["hk_k3"] / best["hvd_k2"],
              "hk_k2/hvd_k2": best["hk_k2"] / best["hvd_k2"]}
    progress("fit: " + ", ".join(f"{v} {best[v]:,.0f}" for v in best) + " samples/s; "
             + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return {"batch_per_rank": batch, "ranks": NP, "epochs": epochs, "repeats": repeats,
            "hidden_units": hidden_units, "samples_per_sec": best, "all_runs": dict(runs),
            "ratios": ratios, "variants": {k: v[0] for k, v in FIT_VARIANTS.items()},
            "counts": FIT_COUNTS}


# --- issue 17's speed targets: the Keras paths against Keras' and Horovod's own -----------

def _keras_env(keras2: bool) -> dict:
    env = bench.env(**({"TF_USE_LEGACY_KERAS": "1"} if keras2 else {}))
    if not keras2:
        env.pop("TF_USE_LEGACY_KERAS", None)
    return env


def _fastest(epochs):
    """samples/s of the fastest epoch but the first: these epochs last 0.05-0.5 s, so one
    burst of another process's work decides an epoch's time, and the least disturbed epoch is
    the one that measures the code."""
    return max(e["samples_per_sec"] for e in epochs[1:] or epochs)


def _paired_ratios(record) -> list:
    """A paired launch's ratios, one per epoch after the first: the seconds of Horovod's fit's
    epoch over those of the hk.fit epoch just before it (> 1: hk.fit the faster)."""
    return [b["seconds"] / a["seconds"]
            for a, b in zip(record["epochs"][1:], record["paired_epochs"][1:])]


def keras_speed(out, global_batch, epochs, repeats, spes=(1, 64), kerases=("k2", "k3"),
                bn_units=1024, bn_every=100, pair_epochs=30) -> dict:
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
    softmax = {"label": "softmax", "model": "softmax", "hidden_units": 256, "lr": 0.5,
               "dataset": DATASET}
    per_rank = global_batch // NP
    launches = {}  # name: (group, command for an output path or None: the Task path, Keras 2?)

    def worker(impl, batch, *flags):
        return lambda path: bench.python(WORKERS, "fit", "--impl", impl, "--out", path,
                                         "--batch", batch, "--epochs", epochs,
                                         "--dataset", DATASET, *flags)

    soft = ("--model", "softmax", "--lr", softmax["lr"])
    for spe in spes:
        for name, impl, keras2, extra in (
                (f"hk_k2_spe{spe}", "hk", True, ()),
                (f"hvd_k2_spe{spe}", "hvd_keras", True, ("--input", "dataset")),
                (f"hvd_arrays_k2_spe{spe}", "hvd_keras", True, ("--input", "arrays")),
                (f"hk_k3_spe{spe}", "hk", False, ())):
            cmd = worker(impl, per_rank, "--spe", spe, *soft, *extra)
            launches[name] = ("fit", lambda p, c=cmd: bench.horovodrun(NP, CONTROLLER, c(p)),
                              keras2)
    for spe in spes:
        for tag in kerases:
            cmd = lambda path, spe=spe: bench.horovodrun(NP, CONTROLLER, bench.python(
                WORKERS, "fit", "--impl", "pair", "--out", path, "--batch", per_rank,
                "--epochs", pair_epochs, "--dataset", DATASET, "--spe", spe, *soft))
            launches[f"pair_{tag}_spe{spe}"] = ("pair", cmd, tag == "k2")
    for tag in kerases:
        keras2 = tag == "k2"
        launches[f"task_{tag}"] = ("task1", None, keras2)
        launches[f"keras_{tag}"] = ("task1", worker("keras", global_batch, "--spe", 64, *soft),
                                    keras2)
    for name, extra in (("bn_sync", ()), ("bn_nosync", ("--no-bn-sync",))):
        cmd = worker("hk", per_rank, "--model", "mlp", "--bn", "--hidden-units", bn_units,
                     "--lr", 0.05, "--checkpoint-every", bn_every, *extra)
        launches[name] = ("bn", lambda p, c=cmd: bench.horovodrun(NP, CONTROLLER, c(p)), False)
    work = os.path.join(out, "runs")
    runs, sync_share, paired = collections.defaultdict(list), [], collections.defaultdict(list)
    for _ in range(repeats):
        for name, (group, cmd, keras2) in launches.items():
            if cmd is None:  # the Task path, as the throughput case runs it
                records, _ = run_variant("b", softmax, global_batch, epochs, work,
                                         {"TF_USE_LEGACY_KERAS": "1" if keras2 else "0"},
                                         flags=("--steps-per-execution", 64), tag=f"-{name}")
            else:
                path = os.path.join(out, "raw", f"keras_speed-{name}.json")
                bench.run(cmd(path), _keras_env(keras2))
                record = _load(path)
                records = record["epochs"]
                if group == "pair":
                    paired[name] += _paired_ratios(record)
                if name == "bn_sync":  # the sync's own seconds against the training's
                    sync_share.append(record["bn_sync"]["seconds"]
                                      / sum(e["seconds"] for e in records))
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
    return {"global_batch": global_batch, "ranks": NP, "epochs": epochs, "repeats": repeats,
            "spes": list(spes), "kerases": list(kerases), "bn_units": bn_units,
            "bn_every": bn_every, "pair_epochs": pair_epochs, "paired": dict(paired),
            "samples_per_sec": best, "all_runs": dict(runs), "ratios": ratios,
            "groups": {k: v[0] for k, v in launches.items()}, "counts": KERAS_SPEED_COUNTS}


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
        bench.run(bench.python(WORKERS, "tfrecords", "--files", files, "--dataset", DATASET,
                               "--out", data_dir + ".tmp"), bench.env())
        os.replace(data_dir + ".tmp", data_dir)
    common = ("--model", "mlp", "--epochs", epochs, "--hidden-units", hidden_units, "--lr", lr,
              "--dataset", DATASET)
    env = _keras_env(True)
    runs = collections.defaultdict(list)
    for _ in range(repeats):
        for name in PIPELINE_VARIANTS:
            path = os.path.join(out, "raw", f"pipeline-{name}.json")
            if name == "mwms_tfrecord":
                records, _ = _mwms(path, batch, list(common), env, worker=(
                    "fit", "--impl", "mwms", "--input", "tfrecord", "--data-dir", data_dir))
            else:
                extra = ("--input", "tfrecord", "--data-dir", data_dir) \
                    if name == "hk_tfrecord" else ()
                bench.run(bench.horovodrun(NP, CONTROLLER, bench.python(
                    WORKERS, "fit", "--impl", "hk", "--out", path, "--batch", batch,
                    *common, *extra)), env)
                records = _load(path)["epochs"]
            runs[name].append(_steady(records))
            progress(f"pipeline {name}: {runs[name][-1]:,.0f} samples/s")
    best = {v: max(r) for v, r in runs.items()}
    ratios = {"tfrecord/arrays": best["hk_tfrecord"] / best["hk_arrays"],
              "hk/mwms": best["hk_tfrecord"] / best["mwms_tfrecord"]}
    progress("pipeline: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return {"batch_per_rank": batch, "ranks": NP, "epochs": epochs, "repeats": repeats,
            "files": files, "hidden_units": hidden_units, "samples_per_sec": best,
            "all_runs": dict(runs), "ratios": ratios, "variants": dict(PIPELINE_VARIANTS),
            "counts": PIPELINE_COUNTS}
