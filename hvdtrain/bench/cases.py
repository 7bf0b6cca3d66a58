"""The benchmark cases of Horovod and TensorFlow themselves: each launches real processes side by side and returns plain dicts.

    allreduce(...)   hvd.allreduce (MPI and Gloo controllers), mpi4py Allreduce, numpy copy
    throughput(...)  (a) plain TF, (b) hvdtrain 1 process (and 1 thread), (c) hvdtrain 2
                     processes, (d) MultiWorkerMirroredStrategy 2 workers: samples/s
    tta(...)         seconds of training to a test accuracy, and the process wall time of the
                     same job: hvdtrain 1 and 2 processes, MWMS 2 workers, plain Keras
    steps_per_call(...)  hvdtrain at several --steps-per-execution values, 1 and 2 processes
    timeline(...)    one hvdtrain run under HOROVOD_TIMELINE, summarised per activity

The Keras fit comparisons (fit, keras_speed, pipeline) are in ``fit_cases``; both modules'
launches run ``workers`` (and its ``fit_workers``).
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil

import numpy as np

from hvdtrain import bench
from hvdtrain.bench import BenchError, progress

WORKERS = "hvdtrain.bench.workers"
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


def allreduce(out: str, sizes, scale: float = 1.0) -> dict:
    """Latency, algbw and busbw per size for each implementation.

    Launches go round-robin (memcpy, hvd_mpi, hvd_gloo, mpi4py, ..., then again) and each
    series keeps, per size, its best launch; each launch keeps its best timed round. The full
    suite (scale >= 1) runs 2 repeats and adds hvd_mpi_graph (the allreduce inside a
    tf.function, as a training step calls it), hvd_mpi_bare (no tunable from the caller: the
    ranks' own re-exec sets it, as under a user's bare horovodrun) and hvd_mpi_4k (hvd_mpi
    without the huge-page setting from anywhere: HVDTRAIN_HUGETLB=0).
    """
    flags = ["--sizes", ",".join(map(str, sizes)), "--scale", scale]

    def hvd(controller, f, *extra):
        return bench.horovodrun(
            NP,
            controller,
            bench.python(WORKERS, "allreduce", "--impl", "hvd", "--out", f, *flags, *extra),
        )

    launches = {  # name: (command for an output path, extra environment)
        "memcpy": (lambda f: bench.python(WORKERS, "memcpy", "--out", f, *flags), ALLREDUCE_ENV),
        "hvd_mpi": (lambda f: hvd("mpi", f), ALLREDUCE_ENV),
        "hvd_gloo": (lambda f: hvd("gloo", f), ALLREDUCE_ENV),
        # the Open MPI setting hvdtrain gives Horovod's ranks on a full machine (distributed.
        # _horovod_defaults): no effect on a quiet machine, fewer stolen slices on a busy one
        "mpi4py": (
            lambda f: bench.mpirun(
                NP, bench.python(WORKERS, "allreduce", "--impl", "mpi4py", "--out", f, *flags)
            ),
            dict(ALLREDUCE_ENV, OMPI_MCA_mpi_yield_when_idle="1"),
        ),
    }
    repeats = 1
    if scale >= 1:
        repeats = 2
        launches["hvd_mpi_graph"] = (lambda f: hvd("mpi", f, "--mode", "graph"), ALLREDUCE_ENV)
        # a bare horovodrun, nothing set by the caller: each rank starts itself again with
        # the tunable as it imports hvdtrain (base/malloc.py); what a user's own launch gets
        launches["hvd_mpi_bare"] = (lambda f: hvd("mpi", f), {})
        # without the tunable: neither from here nor from the ranks' own re-exec
        launches["hvd_mpi_4k"] = (lambda f: hvd("mpi", f), {"HVDTRAIN_HUGETLB": "0"})
    best, ranks = {}, {}
    for _ in range(repeats):
        for name, (cmd, extra) in launches.items():
            path = os.path.join(out, "raw", f"allreduce-{name}.json")
            environ = bench.env(**extra)
            if "GLIBC_TUNABLES" not in extra:
                environ.pop("GLIBC_TUNABLES", None)
            wall = bench.run(cmd(path), environ, timeout=300)
            data = _load(path)
            ranks[name] = data["ranks"]
            for row in data["rows"]:
                kept = best.setdefault(name, {}).get(row["bytes"])
                if kept is None or row["seconds"] < kept["seconds"]:
                    best[name][row["bytes"]] = row
            big = data["rows"][-1]
            progress(
                f"allreduce {name:13s} {big['bytes'] >> 20} MiB: {big['seconds'] * 1e3:.2f} "
                f"ms ({wall:.0f}s)"
            )
    series = {}
    for name in launches:
        rows = [best[name][b] for b in sorted(best[name])]
        for row in rows:
            row["algbw"] = bench.algbw(row["bytes"], row["seconds"])
            row["busbw"] = (
                bench.busbw(row["bytes"], row["seconds"], ranks[name])
                if name != "memcpy"
                else row["algbw"]
            )
        series[name] = rows
    big = {n: s[-1] for n, s in series.items()}
    progress(
        f"allreduce {big['mpi4py']['bytes'] >> 20} MiB busbw: "
        + ", ".join(f"{n} {r['busbw'] / 1e9:.2f}" for n, r in big.items())
        + " GB/s"
    )
    return {
        "ranks": NP,
        "sizes": list(sizes),
        "series": series,
        "repeats": repeats,
        "environment": ALLREDUCE_ENV,
    }


# --- training throughput -------------------------------------------------------------------


def _hvdtrain_flags(spec, batch, run_dir, epochs, np_):
    return [
        "--dataset",
        spec["dataset"],
        "--model",
        spec["model"],
        "--hidden-units",
        spec["hidden_units"],
        "--learning-rate",
        spec["lr"],
        "--batch-size",
        batch,
        "--epochs",
        epochs,
        "--num-workers",
        np_,
        "--checkpoint-every",
        0,
        "--keep-checkpoints",
        1000,
        "--verbose",
        0,
        "--run-dir",
        run_dir,
        *(["--no-download"] if spec["dataset"] == "mnist" else []),
    ]  # the bundled sample


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
    worker_flags = [
        "--dataset",
        spec["dataset"],
        "--model",
        spec["model"],
        "--hidden-units",
        spec["hidden_units"],
        "--lr",
        spec["lr"],
        "--epochs",
        epochs,
    ]
    out = os.path.join(run_dir, "out.json")
    if variant == "a":
        wall = bench.run(
            bench.python(WORKERS, "plain", "--out", out, "--batch", global_batch, *worker_flags),
            env,
        )
        return _load(out)["epochs"], wall
    if variant == "d":
        return _mwms(out, global_batch // NP, worker_flags, env)
    np_ = NP if variant == "c" else 1
    per_rank = {"b_rank": global_batch // NP}.get(variant, global_batch // np_)
    if variant == "b1":
        env.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    cmd = bench.python(
        "hvdtrain.mnist", *_hvdtrain_flags(spec, per_rank, run_dir, epochs, np_), *flags
    )
    wall = bench.run(bench.horovodrun(NP, CONTROLLER, cmd) if np_ > 1 else cmd, env)
    return _metrics(run_dir), wall


def _mwms(out, per_worker, worker_flags, env, target=0.0, worker=("mwms",), module=WORKERS):
    ports = bench.free_ports(NP)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    import subprocess
    import time

    tick = time.perf_counter()
    for index in range(NP):
        e = dict(
            env,
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        )
        cmd = bench.python(
            module,
            *worker,
            "--index",
            index,
            "--out",
            out,
            "--batch",
            per_worker,
            "--target",
            target,
            *worker_flags,
        )
        procs.append(
            subprocess.Popen(
                cmd,
                env=e,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
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


VARIANTS = {
    "a": "plain TF, 1 process",
    "b": "hvdtrain, 1 process",
    "b1": "hvdtrain, 1 process, 1 thread",
    "c": "hvdtrain, 2 processes",
    "d": "MultiWorkerMirrored, 2 workers",
    "b_rank": "hvdtrain, 1 process, batch of one rank of (c)",
}


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
            rows.append(
                {
                    "model": spec["label"],
                    "global_batch": batch,
                    "samples_per_sec": best,
                    "all_runs": dict(runs),
                    "step_ms": {
                        v: 1e3 * (batch if v != "b_rank" else batch // NP) / best[v]
                        for v in variants
                    },
                    "per_rank_batch": per_rank,
                }
            )
            progress(
                f"throughput {spec['label']} batch {batch}: "
                + ", ".join(f"{v} {best[v]:,.0f}" for v in variants)
                + " samples/s"
            )
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
                    records, _ = run_variant(
                        variant,
                        spec,
                        global_batch,
                        epochs,
                        work,
                        flags=("--steps-per-execution", k),
                        tag=f"-spe{k}",
                    )
                    runs[k].append(_steady(records))
            best = {k: max(r) for k, r in runs.items()}
            rows.append({"model": spec["label"], "variant": variant, "samples_per_sec": best})
            progress(
                f"steps per call {spec['label']} ({variant}): "
                + ", ".join(f"{k or 'auto'} {v:,.0f}" for k, v in best.items())
                + " samples/s"
            )
    return {
        "global_batch": global_batch,
        "epochs": epochs,
        "repeats": repeats,
        "values": list(values),
        "rows": rows,
    }


# --- time to accuracy ----------------------------------------------------------------------


def _accuracy_per_epoch(run_dir, data):
    """Test accuracy of every epoch-end checkpoint (numpy forward pass, outside the timing)."""
    from hvdtrain.engine import checkpoint_file

    x = data.x_test.reshape(-1, 784).astype(np.float32) / 255.0
    found = {}
    for _, path in checkpoint_file.list_checkpoints(os.path.join(run_dir, "checkpoints")):
        meta, arrays = checkpoint_file.read(path)
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
    "b": (
        "hvdtrain, 1 process",
        "python -m hvdtrain.mnist: a checkpoint at each epoch's end "
        "(scored afterwards, outside the process), the test set at the end, model.keras, "
        "result.json",
    ),
    "c": ("hvdtrain, 2 processes", "the same under horovodrun -np 2 --mpi"),
    "d": (
        "MWMS, 2 workers",
        "MultiWorkerMirroredStrategy, a tf.function step: the test set "
        "scored after each epoch (untimed)",
    ),
    "k": (
        "plain Keras, 1 process",
        "model.fit of the arrays (Keras' defaults: "
        "steps_per_execution 1, shuffled): the test set scored after each epoch (untimed)",
    ),
}


def tta(out, spec, global_batch, target, max_epochs) -> dict:
    """Training seconds until the test accuracy reaches ``target`` (evaluation not counted),
    and each variant's process wall time for the same job: ``max_epochs`` epochs and the test
    set scored (every variant trains them all, whatever epoch reaches the target)."""
    from hvdtrain.distributed import World
    from hvdtrain.inputs.loaders import load_mnist_format

    data = load_mnist_format(spec["dataset"], None, False, World(), notice=lambda m: None)
    work = os.path.join(out, "runs")
    os.makedirs(work, exist_ok=True)
    result = {
        "target": target,
        "global_batch": global_batch,
        "model": spec["label"],
        "lr": spec["lr"],
        "max_epochs": max_epochs,
        "rows": {},
    }
    flags = [
        "--dataset",
        spec["dataset"],
        "--model",
        spec["model"],
        "--hidden-units",
        spec["hidden_units"],
        "--lr",
        spec["lr"],
        "--epochs",
        max_epochs,
    ]
    for variant, (label, does) in TTA_VARIANTS.items():
        timings = None
        if variant == "d":
            records, wall = _mwms(
                os.path.join(work, "tta-d.json"),
                global_batch // NP,
                flags + ["--test-accuracy"],
                bench.env(),
            )
            accuracy = {r["epoch"]: r["test_accuracy"] for r in records}
        elif variant == "k":
            path = os.path.join(work, "tta-k.json")
            wall = bench.run(
                bench.python(
                    WORKERS,
                    "fit",
                    "--impl",
                    "keras",
                    "--out",
                    path,
                    "--batch",
                    global_batch,
                    "--test-accuracy",
                    *flags,
                ),
                bench.keras_env(False),
            )
            records = _load(path)["epochs"]
            accuracy = {r["epoch"]: r["test_accuracy"] for r in records}
        else:
            records, wall = run_variant(variant, spec, global_batch, max_epochs, work)
            run_dir = os.path.join(work, f"{spec['model']}-{global_batch}-{variant}")
            accuracy = _accuracy_per_epoch(run_dir, data)
            timings = _load(os.path.join(run_dir, "result.json")).get("timings")
        reached = next((e for e in sorted(accuracy) if accuracy[e] >= target), None)
        seconds = sum(r["seconds"] for r in records if r["epoch"] <= reached) if reached else None
        result["rows"][variant] = {
            "label": label,
            "does": does,
            "epochs": reached,
            "seconds": seconds,
            "accuracy": accuracy,
            "wall": wall,
            "epochs_run": len(records),
            "train_seconds": sum(r["seconds"] for r in records),
            "timings": timings,
        }
        progress(
            f"time to accuracy {target:.2f}, {label}: "
            + (f"{seconds:.2f} s ({reached} epochs)" if reached else "not reached")
            + f"; process wall {wall:.1f} s for {len(records)} epochs"
        )
    rows = result["rows"]
    result["wall_ratios"] = {
        "c/d": rows["c"]["wall"] / rows["d"]["wall"],
        "b/k": rows["b"]["wall"] / rows["k"]["wall"],
    }
    return result


# --- where the time goes ------------------------------------------------------------------


def timeline(out, spec, global_batch, epochs) -> dict:
    """Run (c) once under HOROVOD_TIMELINE; total time per activity (B/E pairs) per rank 0."""
    path = os.path.join(out, "timeline.json")
    records, _ = run_variant(
        "c", spec, global_batch, epochs, os.path.join(out, "runs"), {"HOROVOD_TIMELINE": path}
    )
    return {
        "path": path,
        "model": spec["label"],
        "global_batch": global_batch,
        "steps": records[-1]["global_step"],
        "epochs": epochs,
        **summarize_timeline(path),
    }


def read_timeline(path) -> list:
    """The events of a Horovod timeline (a JSON array that Horovod may leave unterminated)."""
    with open(path) as f:
        text = f.read().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


# Bytes per element of the dtypes a Horovod timeline names (Horovod's DataType_Name, lower case).
_DTYPE_BYTES = {
    "uint8": 1,
    "int8": 1,
    "bool": 1,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
    "float64": 8,
}


def timeline_collectives(path, kinds=("ALLREDUCE", "ALLGATHER")) -> list:
    """Every finished collective of ``kinds`` in a Horovod timeline, in order, as dicts:
    kind, tensor (its name), dtype, shape (a list) and bytes, those of its output (an
    allreduce's output is its input; an allgather's, every rank's rows together)."""
    events = read_timeline(path)
    tensors = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})
    }
    started, out = {}, []
    for e in events:
        if e.get("ph") == "B" and e.get("name") in kinds:
            started[e["pid"]] = e["name"]
        elif e.get("ph") == "E" and e.get("pid") in started and "shape" in e.get("args", {}):
            dtype, shape = e["args"]["dtype"].lower(), json.loads(e["args"]["shape"])
            out.append(
                {
                    "kind": started.pop(e["pid"]),
                    "tensor": tensors.get(e["pid"], ""),
                    "dtype": dtype,
                    "shape": shape,
                    "bytes": int(np.prod(shape, dtype=np.int64)) * _DTYPE_BYTES[dtype],
                }
            )
    return out


def summarize_timeline(path) -> dict:
    """Seconds and counts per activity name over all tensors, from a Horovod (Chrome trace)
    timeline; ``allreduce_rounds``: the allreduce negotiation rounds, a grouped allreduce's
    tensors (named ``..._KofN``) counting once; ``training_rounds``: those from the first
    grouped round (the first step's) to the last, inclusive: the steps' and what runs between
    them, without the run's start and end (its agreement questions, the final scoring)."""
    events = read_timeline(path)
    tensors = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})
    }
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
    return {
        "seconds": dict(totals.most_common()),
        "counts": dict(counts),
        "allreduce_rounds": rounds,
        "training_rounds": grouped_at[-1] - grouped_at[0] + 1 if grouped_at else 0,
    }
