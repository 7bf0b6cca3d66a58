"""The benchmark suite's own code, cheaply: formulas, tables, defaults, one tiny real case.

No assertion is on a timing: the machine may be busy; only shapes and formulas are checked.
"""

import json
import os
import shlex
import sys

import pytest

from conftest import ROOT, clean_env, run
from docs_pages import block
from hvdtrain import bench
from hvdtrain.bench import cases, fit_cases, report
from hvdtrain.distributed import horovod_setup


@pytest.mark.quick
def test_bus_bandwidth_is_nccl_tests_definition():
    assert bench.algbw(1e9, 0.5) == 2e9
    assert bench.busbw(1e9, 0.5, 2) == pytest.approx(2e9)  # 2(n-1)/n = 1
    assert bench.busbw(1e9, 1.0, 4) == pytest.approx(1.5e9)  # 2*3/4
    assert bench.busbw(1e9, 1.0, 1) == 0.0


@pytest.mark.quick
def test_table_and_acceptance():
    text = report.table(["a", "b"], [(1, 2.5), ("x", None), (3, 12345.6)])
    assert text.splitlines() == [
        "| a | b |",
        "| --- | --- |",
        "| 1 | 2.5 |",
        "| x | - |",
        "| 3 | 12,346 |",
    ]
    s = {"a": 100.0, "b": 99.0, "b1": 70.0, "c": 114.0, "d": 80.0}
    results = {
        "machine": "m",
        "throughput": {
            "epochs": 3,
            "repeats": 1,
            "variants": cases.VARIANTS,
            "rows": [
                {"model": "mlp-1024", "global_batch": 64, "samples_per_sec": s, "step_ms": {}}
            ],
        },
    }
    checks = {c[0]: c for c in report.acceptance(results)}
    assert checks["(b)/(a) throughput"][2:] == (0.99, 0.97, True)
    assert checks["(c)/(d) throughput"][4] is True  # 1.425
    assert checks["(c) / 2x(b, 1 thread): scaling efficiency"][4] is False  # 114 / 140
    assert "| mlp-1024 | 64 |" in report.markdown(results, "cmd")


@pytest.mark.quick
def test_timeline_summary(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(
        '[{"ph": "B", "name": "NEGOTIATE", "ts": 0, "pid": 1},'
        '{"ph": "E", "ts": 1500, "pid": 1},'
        '{"ph": "B", "name": "ALLREDUCE", "ts": 2000, "pid": 1},'
        '{"ph": "E", "ts": 2500, "pid": 1},'
    )  # unterminated, as Horovod leaves it
    summary = cases.summarize_timeline(str(path))
    assert summary["seconds"] == {"NEGOTIATE": 0.0015, "ALLREDUCE": 0.0005}


@pytest.mark.quick
def test_timeline_rounds_count_a_group_once(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
        for p, n in (
            (1, "while/HorovodGroupedAllreduce_g_1of2"),
            (2, "while/HorovodGroupedAllreduce_g_2of2"),
            (3, "HorovodAllreduce"),
        )
    ]
    for step in range(5):  # five steps of a two-tensor group, one lone allreduce
        events += [
            {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 10 * step, "pid": p} for p in (1, 2)
        ]
        if step == 2:  # an epoch's metric sums between steps: a training round
            events.append({"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 25, "pid": 3})
    events.append({"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 99, "pid": 3})  # the end's
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    summary = cases.summarize_timeline(str(path))
    assert (summary["allreduce_rounds"], summary["training_rounds"]) == (7, 6)
    results = {
        "machine": "m",
        "timeline": {
            "model": "softmax",
            "global_batch": 8,
            "steps": 5,
            "epochs": 1,
            "allreduce_rounds": 7,
            "training_rounds": 6,
            "seconds": {},
            "counts": {},
        },
    }
    (check,) = report.acceptance(results)
    assert check[2:] == (1.2, 1.05, False)


@pytest.mark.quick
def test_steps_per_call_report():
    steps = {
        "global_batch": 256,
        "epochs": 3,
        "repeats": 1,
        "values": [1, 16, 0],
        "rows": [
            {
                "model": "softmax",
                "variant": "c",
                "samples_per_sec": {"1": 100.0, "16": 250.0, "0": 300.0},
            }
        ],
    }
    text = report.markdown(
        {
            "machine": "m",
            "steps": steps,
            "core_speed": {"matmul_gflops": 50.0, "python_mops": 30.0, "copy_gbps": 10.0},
        },
        "cmd",
    )
    assert "| model | processes | 1 | 16 | auto | auto/1 |" in text
    assert "| softmax | 2 | 100 | 250 | 300 | 3 |" in text
    assert "matmul 50.0 GFLOP/s" in text


@pytest.mark.quick
def test_horovod_defaults_respect_the_user(monkeypatch):
    monkeypatch.setattr(horovod_setup, "usable_cores", lambda: 2)
    environ = {"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "2"}
    assert horovod_setup._horovod_defaults(environ) == {
        "HOROVOD_CYCLE_TIME": "0.1",
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "600",
    }
    # One rank: Horovod's own 1 ms cycle (a 0.1 ms one only steals the compute threads' time).
    assert "HOROVOD_CYCLE_TIME" not in horovod_setup._horovod_defaults({})
    assert horovod_setup._horovod_defaults({"HOROVOD_ELASTIC": "1"})["HOROVOD_CYCLE_TIME"] == "0.1"
    user = {
        "HOROVOD_CYCLE_TIME": "5",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0",
    }
    assert horovod_setup._horovod_defaults(user) == {} and user["HOROVOD_CYCLE_TIME"] == "5"


def bench_plan(command):
    """The bench's reading of a printed ``python -m hvdtrain.bench ...`` command line."""
    from hvdtrain.bench.__main__ import plan

    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "hvdtrain.bench"], command
    return plan(words[3:])


@pytest.mark.quick
def test_the_performance_pages_commands_run_the_cases_they_say():
    """Each bench command of the performance pages, read by the bench as it reads its command
    line: the cases, the level and the output directory the page says (running them takes
    from minutes to an hour; the --smoke runs below run each case)."""
    from hvdtrain.bench.__main__ import CASES, QUICK_CASES

    everything, quick, one = block(
        "performance/reproduce.md", "python -m hvdtrain.bench --out bench-out"
    ).commands()
    assert (bench_plan(everything).chosen, bench_plan(everything).level) == (list(CASES), "full")
    assert (bench_plan(quick).chosen, bench_plan(quick).level) == (list(QUICK_CASES), "quick")
    assert bench_plan(one).chosen == ["keras_speed"] and bench_plan(one).level == "full"
    pages = {
        "index.md": list(CASES),
        "suite.md": list(CASES),
        "input-pipelines.md": ["pipeline"],
        "keras-paths.md": ["keras_speed"],
    }
    held = [
        block("performance/index.md", "python -m hvdtrain.bench --out bench-out"),
        block("performance/suite.md", "python -m hvdtrain.bench --out bench-out"),
        block("performance/input-pipelines.md", "python -m hvdtrain.bench --cases pipeline"),
        block("performance/keras-paths.md", "python -m hvdtrain.bench --cases keras_speed"),
    ]
    for page_block in held:
        (command,) = page_block.commands()
        args = bench_plan(command)
        assert args.chosen == pages[os.path.basename(page_block.page)], page_block
        assert args.out == os.path.abspath("bench-out") and args.level == "full", page_block
    with pytest.raises(SystemExit) as e:  # a case that is not one: exit 2 (argparse's)
        bench_plan("python -m hvdtrain.bench --cases keras_sped")
    assert e.value.code == 2


def _bench_smoke(tmp, cases_, *more):
    """One ``python -m hvdtrain.bench --smoke`` of ``cases_`` (the models cases on the mlp,
    the allreduce case at 4 and 64 KiB), with ``more`` flags: (its process, its output
    directory)."""
    out = tmp / "out"
    proc = run(
        [
            sys.executable,
            "-m",
            "hvdtrain.bench",
            "--smoke",
            "--cases",
            cases_,
            "--models",
            "mlp",
            "--sizes",
            "4096,65536",
            *more,
            "--out",
            str(out),
        ],
        clean_env(tmp / "home", extras=True),  # the plots' matplotlib
        timeout=900,
        cwd=ROOT,
    )
    return proc, out


# The bench's smoke tier in CI: the models case on its smallest model, hvdtrain's two paths
# against Horovod's tape and one process: 4 launches, the two paths' under the timeline.
CI_VARIANTS = ("one", "task", "hk_fit", "tape")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The bench's smoke tier in CI: one ``--smoke`` run of the models case's ``CI_VARIANTS``
    (4 launches). Every other launching case and variant is the ``bench`` tier's
    (``bench_smoke``)."""
    return _bench_smoke(
        tmp_path_factory.mktemp("smoke"), "models", "--variants", ",".join(CI_VARIANTS)
    )


@pytest.fixture(scope="module")
def bench_smoke(tmp_path_factory):
    """Every launching case at its smallest: allreduce, keras_speed, pipeline, sparse, models
    (every variant) and models_np1 (34 launches: about 2.5 minutes here). Marked ``bench``:
    ``pytest -m bench tests/runs/test_bench.py`` runs them before a measurement;
    ``scripts/test.sh`` does not."""
    return _bench_smoke(
        tmp_path_factory.mktemp("bench_smoke"),
        "allreduce,keras_speed,pipeline,sparse,models,models_np1",
    )


@pytest.mark.bench
def test_tiny_allreduce_case_through_the_real_launchers(bench_smoke):
    """memcpy, hvd.allreduce under horovodrun --mpi and --gloo, mpi4py under mpirun."""
    proc, out = bench_smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    series = results["allreduce"]["series"]
    assert set(series) == {"memcpy", "hvd_mpi", "hvd_gloo", "mpi4py"}
    for rows in series.values():
        assert [r["bytes"] for r in rows] == [4096, 65536]
        assert all(r["seconds"] > 0 and r["busbw"] > 0 for r in rows)
    assert "hvd.allreduce (MPI) busbw / mpi4py" not in (out / "results.md").read_text()  # < 4 MiB
    assert (out / "bench_allreduce.png").stat().st_size > 1000


@pytest.mark.quick
def test_fit_case_report():
    """The fit case's section: every variant's samples/s and the ratios, side by side."""
    fit = {
        "ranks": 2,
        "batch_per_rank": 64,
        "hidden_units": 256,
        "repeats": 1,
        "epochs": 3,
        "samples_per_sec": {"hk_k3": 900.0, "hk_k2": 1100.0, "hvd_k2": 1000.0, "hvd_k3": 800.0},
        "ratios": {"hk_k3/hvd_k3": 1.125, "hk_k3/hvd_k2": 0.9, "hk_k2/hvd_k2": 1.1},
        "variants": {k: v[0] for k, v in fit_cases.FIT_VARIANTS.items()},
    }
    text = report.markdown({"machine": "m", "fit": dict(fit, counts=fit_cases.FIT_COUNTS)}, "cmd")
    assert fit_cases.FIT_COUNTS in text and "inside the timed epoch" in text
    assert "| hvdtrain.keras fit, Keras 3 | 900 |" in text
    assert "| Horovod's keras wrapper + broadcast callback, Keras 2 | 1,000 |" in text
    assert "| Horovod's keras wrapper + broadcast callback, Keras 3 | 800 |" in text
    assert "| hk_k3/hvd_k2 | 0.9 |" in text and "| hk_k3/hvd_k3 | 1.12 |" in text


def _tta(walls):
    """A tta result: the four variants' process walls (b, c, d, k), 8 s of training each."""
    rows = {
        v: {
            "label": label,
            "does": does,
            "seconds": 5.0,
            "epochs": 3,
            "wall": w,
            "train_seconds": 8.0,
            "accuracy": {},
        }
        for (v, (label, does)), w in zip(cases.TTA_VARIANTS.items(), walls)
    }
    return {
        "target": 0.8,
        "global_batch": 512,
        "model": "softmax",
        "lr": 0.5,
        "max_epochs": 4,
        "rows": rows,
        "wall_ratios": {
            "c/d": rows["c"]["wall"] / rows["d"]["wall"],
            "b/k": rows["b"]["wall"] / rows["k"]["wall"],
        },
    }


@pytest.mark.quick
def test_tta_process_wall_rows_and_table():
    """Issue 28's two process-wall targets, each either side of its threshold; the table
    puts the wall beside the training seconds and says what each variant's process does."""
    where = "softmax, 4 epochs and the test set"
    checks = {c[0]: c for c in report.acceptance({"tta": _tta([12.0, 16.0, 20.0, 12.0])})}
    assert checks["process wall: hvdtrain 2 processes / MWMS 2 workers"][1:] == (
        where,
        0.8,
        0.8,
        True,
    )
    assert checks["process wall: hvdtrain 1 process / plain Keras 1 process"][2:] == (
        1.0,
        1.0,
        True,
    )
    worse = {c[0]: c[4] for c in report.acceptance({"tta": _tta([12.1, 16.1, 20.0, 12.0])})}
    assert not worse["process wall: hvdtrain 2 processes / MWMS 2 workers"]
    assert not worse["process wall: hvdtrain 1 process / plain Keras 1 process"]
    text = report.markdown({"machine": "m", "tta": _tta([12.0, 16.0, 20.0, 10.0])}, "cmd")
    assert "| hvdtrain, 2 processes | 5 | 3 | 8 | 16 | 2 |" in text  # wall / training 2
    assert "| hvdtrain 1 process / plain Keras 1 process | 1.2 | <= 1 |" in text
    assert "| process wall: hvdtrain 2 processes / MWMS 2 workers |" in text
    assert "<= 0.8 | yes |" in text and "<= 1 | **no** |" in text
    assert "- plain Keras, 1 process: model.fit" in text
    # A results.json from before issue 28 (no walls' ratios) still reports.
    old = _tta([1.0] * 4)
    del old["wall_ratios"]
    assert not [c for c in report.acceptance({"tta": old}) if c[0].startswith("process")]


def _keras_speed(hk_k2=90.0, task=300.0, nosync=100.0, share=0.01, pair=None):
    s = {
        "hk_k2_spe1": hk_k2,
        "hvd_k2_spe1": 100.0,
        "hvd_arrays_k2_spe1": 80.0,
        "hk_k3_spe1": 70.0,
        "task_k3": task,
        "keras_k3": 200.0,
        "bn_sync": 100.0,
        "bn_nosync": nosync,
    }
    ratios = {
        "fit_k2_spe1": s["hk_k2_spe1"] / max(s["hvd_k2_spe1"], s["hvd_arrays_k2_spe1"]),
        "fit_k3_spe1": s["hk_k3_spe1"] / max(s["hvd_k2_spe1"], s["hvd_arrays_k2_spe1"]),
        "task1_k3": s["task_k3"] / s["keras_k3"],
        "bn_sync_cost": s["bn_nosync"] / s["bn_sync"] - 1,
        "bn_sync_share": share,
    }
    paired = {}
    if pair is not None:  # the paired launches' epoch ratios (results before them had none)
        paired = {"pair_k3_spe1": pair}
        ratios["pair_k3_spe1"] = sorted(pair)[len(pair) // 2]  # odd counts: the median
    return {
        "global_batch": 256,
        "ranks": 2,
        "epochs": 5,
        "repeats": 2,
        "spes": [1],
        "kerases": ["k3"],
        "bn_units": 1024,
        "bn_every": 100,
        "samples_per_sec": s,
        "ratios": ratios,
        "pair_epochs": 30,
        "paired": paired,
    }


@pytest.mark.quick
def test_keras_speed_acceptance_rows_and_tables():
    """Issue 17's three targets, each with its threshold and direction, at their edges."""
    results = {"machine": "m", "keras_speed": _keras_speed(nosync=106.0)}
    checks = {(c[0], c[1]): c for c in report.acceptance(results)}
    fit = checks[
        "fit path, 2 processes: hk.fit / Horovod's Keras fit (tf_keras)",
        "softmax, batch 256, tf_keras, steps_per_execution 1",
    ]
    assert fit[2:] == (0.9, 1.0, False)  # 90 against Horovod's faster input (100, not 80)
    task = checks[
        "Task path, 1 process / one-process Keras fit, steps_per_execution 64",
        "softmax, batch 256, Keras 3",
    ]
    assert task[2:] == (1.5, 1.0, True)
    share, bn = [c for k, c in checks.items() if k[0].startswith("BN sync")]
    assert share[2:] == (0.01, 0.05, True)
    assert bn[2] == pytest.approx(0.06) and bn[3:] == (0.05, False)  # 6 % more step time
    text = report.markdown(results, "cmd")
    assert "| 2 processes, steps_per_execution 1 | 90 | 70 | 100 | 80 | 0.9 | 0.7 |" in text
    assert "| Keras 3 | 300 | 200 | 1.5 |" in text
    assert "<= 0.05 | **no** |" in text
    edge = [
        c[4]
        for c in report.acceptance(
            {"keras_speed": _keras_speed(hk_k2=100.0, task=200.0, nosync=104.9, share=0.05)}
        )
    ]
    assert edge == [True, True, True, True]  # exactly 1.0 holds, 5 % holds; 4.9 % holds
    assert not report.acceptance({"keras_speed": _keras_speed(nosync=105.1)})[-1][4]


@pytest.mark.quick
def test_keras_speed_paired_fits_row_and_table():
    """The paired fits' row (the median of the epoch pairs' ratios, target 1.0, exactly 1.0
    holding) and their table (pairs, least, median, most); results without them report as
    before."""
    row = "fit path, 2 processes, epochs paired in the same processes: hk.fit / Horovod's Keras fit"
    where = "softmax, batch 256, Keras 3, steps_per_execution 1"
    for pair, median, holds, line in (
        ([0.9, 1.2, 1.0], 1.0, True, "| 3 | 0.9 | 1 | 1.2 |"),
        ([1.3, 0.99, 0.8], 0.99, False, "| 3 | 0.8 | 0.99 | 1.3 |"),
    ):
        results = {"machine": "m", "keras_speed": _keras_speed(pair=pair)}
        checks = {(c[0], c[1]): c for c in report.acceptance(results)}
        assert checks[row, where][2:] == (median, 1.0, holds)
        text = report.markdown(results, "cmd")
        assert "(30 epochs a launch)" in text
        assert "| Keras 3, steps_per_execution 1 " + line in text
    results = {"machine": "m", "keras_speed": _keras_speed()}
    assert not [c for c in report.acceptance(results) if c[0] == row]
    assert "paired fits" not in report.markdown(results, "cmd")


@pytest.mark.bench
def test_keras_speed_case_through_the_real_launchers(bench_smoke):
    """The keras_speed case end to end, at its smallest (--smoke: the bundled sample, every
    launch once): hk.fit and Horovod's Keras fit under horovodrun, the Task path and plain
    model.fit in one process, the BN mlp synced and not."""
    proc, out = bench_smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["level"] == "smoke"
    ks = results["keras_speed"]
    assert set(ks["samples_per_sec"]) == {
        "hk_k2_spe8",
        "hvd_k2_spe8",
        "hvd_arrays_k2_spe8",
        "hk_k3_spe8",
        "pair_k3_spe8",
        "task_k3",
        "keras_k3",
        "bn_sync",
        "bn_nosync",
    }
    # the paired launch: 3 epochs of each fit, so 2 pairs after the first, their median
    pairs = ks["paired"]["pair_k3_spe8"]
    assert len(pairs) == 2 and all(v > 0 for v in pairs)
    assert ks["ratios"]["pair_k3_spe8"] == pytest.approx(sum(pairs) / 2)
    assert all(v > 0 for v in ks["samples_per_sec"].values())
    s = ks["samples_per_sec"]
    assert ks["ratios"]["task1_k3"] == pytest.approx(s["task_k3"] / s["keras_k3"])
    text = (out / "results.md").read_text()
    for target in (
        "hk.fit / Horovod's Keras fit",
        "epochs paired in the same processes",
        "Task path, 1 process",
        "BN sync",
    ):
        assert target in text
    assert 0 < ks["ratios"]["bn_sync_share"] < 1  # the sync ran and was timed


def _pipeline(tfrecord=90.0, hk_mwms=130.0):
    s = {"hk_arrays": 100.0, "hk_tfrecord": tfrecord, "mwms_tfrecord": tfrecord * 100 / hk_mwms}
    return {
        "batch_per_rank": 64,
        "ranks": 2,
        "epochs": 3,
        "repeats": 1,
        "files": 8,
        "hidden_units": 256,
        "samples_per_sec": s,
        "ratios": {
            "tfrecord/arrays": s["hk_tfrecord"] / s["hk_arrays"],
            "hk/mwms": s["hk_tfrecord"] / s["mwms_tfrecord"],
        },
        "variants": dict(fit_cases.PIPELINE_VARIANTS),
    }


@pytest.mark.quick
def test_pipeline_acceptance_rows_and_tables():
    """Issue 18's two targets, each with its threshold, either side of it."""
    where = "mlp-256, 2 processes, batch 64 per rank, 8 files"
    checks = {c[0]: c for c in report.acceptance({"pipeline": _pipeline()})}
    files = checks["hk.fit: TFRecord files through tf.data / arrays in memory"]
    assert files[1] == where and files[2] == pytest.approx(0.9) and files[3:] == (0.9, True)
    mwms = checks["tf.data pipeline: hk.fit / MultiWorkerMirroredStrategy fit (auto-sharded)"]
    assert mwms[2] == pytest.approx(1.3) and mwms[3:] == (1.3, True)
    below = [c[4] for c in report.acceptance({"pipeline": _pipeline(89.9, 129.9)})]
    assert below == [False, False]
    text = report.markdown({"machine": "m", "pipeline": _pipeline(95.0, 140.0)}, "cmd")
    assert "| hk.fit, TFRecord files through tf.data | 95 |" in text
    assert "| hk.fit, arrays in memory (hk.dataset) | 100 |" in text
    assert "| tfrecord/arrays | 0.95 |" in text and "| hk/mwms | 1.4 |" in text
    assert "| 1.4 | >= 1.3 | yes |" in text


@pytest.mark.bench
def test_pipeline_case_through_the_real_launchers(bench_smoke):
    """The pipeline case end to end, at its smallest (--smoke: the bundled sample): the
    TFRecord files written once, hk.fit from arrays and from the files under horovodrun,
    MultiWorkerMirroredStrategy's fit on the same files as two workers."""
    proc, out = bench_smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    pl = json.loads((out / "results.json").read_text())["pipeline"]
    assert set(pl["samples_per_sec"]) == set(fit_cases.PIPELINE_VARIANTS)
    assert all(v > 0 for v in pl["samples_per_sec"].values())
    s = pl["samples_per_sec"]
    assert pl["ratios"]["hk/mwms"] == pytest.approx(s["hk_tfrecord"] / s["mwms_tfrecord"])
    shards = sorted((out / "tfrecord-mnist-8").iterdir())
    assert [p.name for p in shards] == [f"train-{i:02d}-of-08.tfrecord" for i in range(8)]
    # every one of the sample's 4,000 training digits went into the files, once
    import tensorflow as tf

    assert sum(1 for p in shards for _ in tf.data.TFRecordDataset(str(p))) == 4000
    text = (out / "results.md").read_text()
    assert "TFRecord files through tf.data / arrays in memory" in text
    assert "hk.fit / MultiWorkerMirroredStrategy fit" in text


@pytest.mark.bench
def test_sparse_case_through_the_real_launchers(bench_smoke):
    """The sparse case at its smallest (an Embedding of 20,000 x 8, 16 examples of 4 ids per
    rank, 3 steps): gathered, the step's largest tensor is both ranks' 128 rows and each
    step puts out under 10 KB; dense, it is the table, 640 KB a step. Both trained."""
    proc, out = bench_smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    sp = json.loads((out / "results.json").read_text())["sparse"]
    gathered, dense = sp["variants"]["gathered"], sp["variants"]["dense"]
    assert gathered["largest"] == [128, 8] and gathered["bytes_per_step"] < 10_000, sp
    assert dense["largest"] == [20_000, 8] and dense["bytes_per_step"] > 20_000 * 8 * 4, sp
    assert gathered["allgathers"] >= 2 * 3 and gathered["samples_per_sec"] > 0, sp
    assert dense["samples_per_sec"] > 0, sp
    assert sp["ratios"]["bytes dense/gathered"] > 50, sp
    assert "An Embedding's sparse gradient, 2 processes" in (out / "results.md").read_text()


def _timeline_events(steps, tensors, ready_gap_us, reduce_us):
    """A Horovod timeline of ``steps`` steps of ``tensors`` gradients each (one pid per
    tensor): tensor i ready ``ready_gap_us`` after tensor i-1, each reduced for ``reduce_us``
    from its readiness, its output 1,000 x (i + 1) float32; plus one broadcast at the start
    (a pid negotiated once)."""
    events = [
        {"ph": "B", "name": "NEGOTIATE_BROADCAST", "ts": 0, "pid": 99},
        {"ph": "E", "ts": 5, "pid": 99},
    ]
    for step in range(steps):
        base = 10_000 * (step + 1)
        for t in range(tensors):
            ready = base + t * ready_gap_us
            events += [
                {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": ready - 50, "pid": t},
                {"ph": "E", "ts": ready, "pid": t},
                {"ph": "B", "name": "ALLREDUCE", "ts": ready, "pid": t},
                {
                    "ph": "E",
                    "ts": ready + reduce_us,
                    "pid": t,
                    "args": {"dtype": "FLOAT32", "shape": f"[{1000 * (t + 1)}]"},
                },
            ]
    return events


@pytest.mark.quick
def test_step_split_from_a_timeline(tmp_path):
    """Communication not hidden: from the last gradient ready on every rank to the last
    reduction's end (here the last tensor's 400 us); the earlier tensors' reductions overlap
    the later ones' readiness and count only in 'communication' (first start to last end)."""
    from hvdtrain.bench import model_cases

    path = tmp_path / "t.json"
    events = _timeline_events(steps=6, tensors=3, ready_gap_us=1000, reduce_us=400)
    for i in range(9):  # a run's own allreduce (metric sums, agreement), more often than steps
        events += [
            {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 90_000 + i, "pid": 50},
            {"ph": "E", "ts": 90_001 + i, "pid": 50},
        ]
    # a 7th step whose reductions the timeline lost the ends of (it stops with the process)
    last = _timeline_events(steps=7, tensors=3, ready_gap_us=1000, reduce_us=400)[-12:]
    events += [e for e in last if not (e["ph"] == "E" and e["ts"] % 1000 == 400)]
    path.write_text(json.dumps(events))
    split = model_cases.step_split(str(path), step_seconds=0.010, compute_seconds=0.008)
    # the broadcast's and the 9 sums' pids left out; the 7th step, unfinished, too
    assert (split["tensors"], split["steps"]) == (3, 6)
    assert split["not_hidden"] == pytest.approx(400e-6)
    assert split["communication"] == pytest.approx(2400e-6)  # 0 .. 2000 + 400
    assert split["rest"] == pytest.approx(0.010 - 0.008 - 400e-6)
    assert split["bytes"] == 4 * (1000 + 2000 + 3000)  # each step's three tensors


@pytest.mark.quick
@pytest.mark.parametrize("ended", [1, 2], ids=["one-ended", "two-ended"])
def test_step_split_when_the_timeline_stops_among_a_steps_negotiations(tmp_path, ended):
    """The timeline stops with the process without its last writes: a 7th step whose
    negotiations ended for ``ended`` of the 3 tensors only. All 3 tensors still count, with
    the 6 steps each finished; a collective of the run's own negotiated one time fewer than
    the steps, after them, does not."""
    from hvdtrain.bench import model_cases

    path = tmp_path / "t.json"
    events = _timeline_events(steps=6, tensors=3, ready_gap_us=1000, reduce_us=400)
    for i in range(5):  # e.g. a metric's sums at the end, as often as the steps less one
        events += [
            {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 90_000 + i, "pid": 50},
            {"ph": "E", "ts": 90_001 + i, "pid": 50},
        ]
    last = _timeline_events(steps=7, tensors=3, ready_gap_us=1000, reduce_us=400)[-12:]
    events += [  # each tensor's negotiation began; the first ``ended`` ended, their reductions
        e  # began; no reduction ended
        for e in last
        if e.get("name") == "NEGOTIATE_ALLREDUCE" or (e["pid"] < ended and "args" not in e)
    ]
    path.write_text(json.dumps(events))
    split = model_cases.step_split(str(path), step_seconds=0.010, compute_seconds=0.008)
    assert (split["tensors"], split["steps"]) == (3, 6), split
    assert split["not_hidden"] == pytest.approx(400e-6)
    assert split["bytes"] == 4 * (1000 + 2000 + 3000)


@pytest.mark.quick
def test_models_section_reports_median_spread_and_efficiency():
    from hvdtrain.bench import model_cases

    runs = {v: [100.0, 120.0, 90.0] for v in model_cases.VARIANTS}
    runs["one"] = [60.0, 50.0, 55.0]
    median = {v: sorted(r)[1] for v, r in runs.items()}
    row = {
        "model": "mlp",
        "batch_per_rank": 32,
        "ranks": 2,
        "parameters": 37_801_994,
        "gradient_bytes": 151_207_976,
        "samples_per_sec": median,
        "spread": {v: (min(r), max(r)) for v, r in runs.items()},
        "all_runs": runs,
        "efficiency": {v: median[v] / (2 * median["one"]) for v in median if v != "one"},
        "step_split": {
            "task": {
                "step": 0.64,
                "compute": 0.58,
                "not_hidden": 0.04,
                "rest": 0.02,
                "communication": 0.05,
                "tensors": 9,
                "steps": 12,
            }
        },
    }
    row["paired"] = model_cases.paired(
        dict(runs, hvd_fit_best=[90.0, 150.0, 45.0]), [("task", "hvd_fit_best")]
    )
    assert row["paired"] == {"task/hvd_fit_best": (100 / 90, 0.8, 2.0)}  # per round, paired
    models = {
        "size": "full",
        "steps": 6,
        "epochs": 3,
        "repeats": 3,
        "variants": dict(model_cases.VARIANTS),
        "rows": [row],
    }
    text = report.markdown({"machine": "m", "models": models}, "cmd")
    assert "| mlp | task/hvd_fit_best | 1.11 | 0.8 | 2 |" in text
    assert (
        "| models, 2 processes, paired by round: task/hvd_fit_best | mlp, batch 32 per rank "
        "| 1.11 | >= 1 | yes |"
    ) in text
    assert "median of 3 round-robin launches (least-most)" in text
    assert "| mlp | 32 | 151.2 | 55.0 (50.0-60.0) | 100.0 (90.0-120.0) |" in text
    assert "| mlp | 0.909 | 0.909 |" in text  # 100 / (2 x 55)
    assert "| mlp | task | 640 | 580 | 40 | 20 | 50 | - |" in text


@pytest.mark.quick
def test_models_case_and_projection_on_the_command_line(capsys):
    """--cases models with --models picks the models case's models; a bad one exits 2;
    ``project`` goes to the projection, which launches nothing."""
    from hvdtrain.bench.__main__ import MODELS, main, settings

    args = bench_plan("python -m hvdtrain.bench --cases models --models mlp,bert")
    assert (args.chosen, args.models) == (["models"], ["mlp", "bert"])
    assert bench_plan("python -m hvdtrain.bench --cases models").models == list(MODELS)
    with pytest.raises(SystemExit) as e:
        bench_plan("python -m hvdtrain.bench --models vgg")
    assert e.value.code == 2
    from hvdtrain.bench import model_cases

    assert bench_plan("python -m hvdtrain.bench").variants == list(model_cases.VARIANTS)
    assert bench_plan("python -m hvdtrain.bench --variants tape,task").variants == ["tape", "task"]
    with pytest.raises(SystemExit) as e:
        bench_plan("python -m hvdtrain.bench --variants task,ddp")
    assert e.value.code == 2
    with pytest.raises(bench.BenchError, match=r"unknown variants \['ddp'\]"):
        model_cases.models("/nonexistent", ["mlp"], "smoke", {"mlp": 8}, 3, 2, 1, variants=["ddp"])
    size, batches, steps, epochs, repeats = settings("full")["models"]
    assert (size, repeats, epochs) == ("full", 3, 3) and set(batches) == set(MODELS)
    assert settings("smoke")["models"][0] == "smoke"
    assert main(["project", "--model", "mlp-4096", "--fabric", "ib400x8"]) == 0
    out = capsys.readouterr().out
    assert "wide MLP" in out and "NVLink + 400 Gb/s IB x8" in out


@pytest.mark.quick
def test_the_models_pages_commands_and_projection_tables():
    """performance/models.md: its bench commands run the models case at the levels and on
    the models they say; its projection commands parse as printed; and its projection tables
    and checks are, row for row, what ``project`` prints now, with the calibrated constants
    the code computes (a changed constant fails here until the page is regenerated)."""
    from docs_pages import docs_text
    from hvdtrain.bench import projection
    from hvdtrain.bench.__main__ import MODELS

    full, quick, mlp = (
        bench_plan(c)
        for c in block(
            "performance/models.md", "python -m hvdtrain.bench --cases models"
        ).commands()
    )
    assert (full.chosen, full.level, full.models) == (
        ["models", "models_np1"],
        "full",
        list(MODELS),
    )
    assert (quick.chosen, quick.level, quick.models) == (
        ["models", "models_np1"],
        "quick",
        list(MODELS),
    )
    assert (mlp.chosen, mlp.level, mlp.models) == (["models"], "quick", ["mlp"])
    every, one, yours, measured = (
        projection.plan(shlex.split(c)[4:])
        for c in block("performance/models.md", "python -m hvdtrain.bench project").commands()
    )
    assert len(every.models) == 3 and len(every.fabrics) == 5 and every.overlap == 0.5
    assert one.models == [projection.MODELS["resnet50"]] and one.overlap == 0
    assert (yours.models[0].compute, yours.models[0].gradient_bytes, yours.models[0].batch) == (
        0.12,
        100e6,
        64,
    )
    assert measured.results == "bench-out/results.json"
    printed = projection.markdown(every.models, every.fabrics, every.overlap).splitlines()
    page = docs_text("performance/models.md")
    section = page[page.index("## Projected scaling") :].splitlines()
    constants = section.index("| constant | value | kind |")
    rows = [
        line
        for i, line in enumerate(section)
        if line.startswith("| ") and not (constants <= i < section.index("", constants))
    ]
    assert len(rows) >= 30
    for line in rows:
        assert line in printed, line
    assert f"| {projection.HOST_LATENCY * 1e6:.0f} us |" in page
    assert f"| {projection.HOST_BUSBW / 1e9:.2f} GB/s |" in page


def check_models_smoke(proc, out, variants):
    """A ``--smoke`` models run on the mlp: ``variants`` launched once each (the Task path's
    and the tape's under HOROVOD_TIMELINE, their steps split), samples/s, efficiency,
    gradient bytes, the paired ratios of the pairs launched, the report and the plot."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    from hvdtrain.bench import model_cases

    models = json.loads((out / "results.json").read_text())["models"]
    assert list(models["variants"]) == list(variants)
    (row,) = models["rows"]
    assert row["model"] == "mlp" and row["ranks"] == 2
    # 64 -> 128 -> 128 -> 10, float32: the trainable variables' bytes
    assert row["gradient_bytes"] == 4 * (64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10)
    assert set(row["samples_per_sec"]) == set(variants)
    assert all(v > 0 for v in row["samples_per_sec"].values())
    assert row["efficiency"]["task"] == pytest.approx(
        row["samples_per_sec"]["task"] / (2 * row["samples_per_sec"]["one"])
    )
    # at the smoke level the round's own task and tape launches wrote the timelines
    launched = sorted(
        p.name for p in (out / "raw").glob("models-mlp-*.json") if "-alone-" not in p.name
    )  # (models_np1's launches, in the same folder, are its own)
    assert launched == sorted(
        f"models-mlp-{v}{'-timeline' if v in model_cases.TIMELINE_VARIANTS else ''}.json"
        for v in variants
    )
    for variant in model_cases.TIMELINE_VARIANTS:  # each step's reductions seen and split
        split = row["step_split"][variant]
        assert split["tensors"] >= 6 and split["steps"] >= 3, split
        assert split["not_hidden"] >= 0 and split["communication"] > 0, split
        assert split["rest"] == pytest.approx(
            split["step"] - split["compute"] - split["not_hidden"]
        )
        step = 2 * row["batch_per_rank"] / row["samples_per_sec"][variant]  # 1 round: median
        assert split["step"] == pytest.approx(step)
    # each round's hvdtrain path against each Horovod reference launched (1 round: least =
    # most); Horovod's best Keras fit only where both of its fits ran
    references = [
        b
        for b in model_cases.HOROVOD_REFERENCES
        if b == "tape" or {"hvd_fit", "hvd_fit_tuned"} <= set(variants)
    ]
    assert set(row["paired"]) == {f"{a}/{b}" for a in ("task", "hk_fit") for b in references}
    s = row["samples_per_sec"]
    assert row["paired"]["task/tape"] == pytest.approx([s["task"] / s["tape"]] * 3)
    if "hvd_fit_best" in references:
        best = max(s["hvd_fit"], s["hvd_fit_tuned"])
        assert row["paired"]["task/hvd_fit_best"] == pytest.approx([s["task"] / best] * 3)
    text = (out / "results.md").read_text()
    assert "### Models users train" in text
    assert "| models, 2 processes, paired by round: hk_fit/tape | mlp, batch 8 per rank" in text
    assert (out / "bench_models.png").stat().st_size > 0


def test_models_case_through_the_real_launchers(smoke):
    """The models case end to end on its smallest model (--smoke: a 26,000-parameter MLP), as
    CI runs it: one process, the Task path and hk.fit, and Horovod's tape under horovodrun
    -np 2, the Task path's and the tape's launches under HOROVOD_TIMELINE."""
    check_models_smoke(*smoke, CI_VARIANTS)


@pytest.mark.bench
def test_every_models_variant_through_the_real_launchers(bench_smoke):
    """... and every variant: Horovod's Keras fit at its defaults and tuned, and MWMS as two
    workers, besides."""
    from hvdtrain.bench import model_cases

    check_models_smoke(*bench_smoke, tuple(model_cases.VARIANTS))


@pytest.mark.bench
def test_models_np1_case_through_the_real_launchers(bench_smoke):
    """The one-process comparison at its smallest (models_np1 on the mlp): a plain Keras fit,
    the Task path and hk.fit, alone, under Keras 3 and tf_keras."""
    proc, out = bench_smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    from hvdtrain.bench import model_cases

    alone = json.loads((out / "results.json").read_text())["models_np1"]
    assert [(r["keras"], r["model"]) for r in alone["rows"]] == [("k3", "mlp"), ("k2", "mlp")]
    for r, keras in zip(alone["rows"], ("keras 3.", "tf_keras 2.")):
        assert r["keras_version"].startswith(keras), r["keras_version"]
        assert set(r["samples_per_sec"]) == set(model_cases.ALONE)
        assert all(v > 0 for v in r["samples_per_sec"].values())
        assert r["paired"]["task/fit"][0] == pytest.approx(
            r["samples_per_sec"]["task"] / r["samples_per_sec"]["fit"]
        )
    text = (out / "results.md").read_text()
    assert "one process, no launcher" in text
    assert "| models, 1 process, paired by round: hk_fit/fit | mlp, batch 8, tf_keras" in text
    assert (out / "bench_models_np1.png").stat().st_size > 0
