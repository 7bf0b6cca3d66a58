"""result.json's ``timings`` on both paths, in one process and on 2 ranks: every phase, none
negative, adding up to ``wall``, ``other`` small, ``wall`` within the process's real elapsed
time as measured here from outside; the ``verbose 2`` line. No assertion is on a speed.
"""

import sys
import textwrap
import time

import pytest

import usercode
from conftest import HOROVODRUN, clean_env, launch, module_cmd, result, run
from hvdtrain import distributed

# A fit script with validation (evaluation) and mid-epoch checkpoints: 256 examples, 2 epochs.
from hvdtrain.base import timings
from hvdtrain.distributed import horovod_setup

FIT = textwrap.dedent("""
    import sys
    import numpy as np
    import hvdtrain.keras as hk
    from hvdtrain.compat import keras

    hk.init()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64")
    k = keras()
    model = k.Sequential([k.Input((8,)), k.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    hk.fit(model, hk.dataset(x[:256], y[:256], batch_size=16, seed=1), epochs=2,
           validation_data=(x[256:], y[256:]), run_dir=sys.argv[1], checkpoint_every=5,
           verbose=2)
""")
# Phases every one of these runs spends measurable time in (a fit script builds its model;
# one rank agrees with itself at no cost).
SPENT = (
    "imports",
    "horovod_init",
    "data",
    "first_call",
    "training",
    "evaluation",
    "checkpoints",
    "model_save",
    "results",
)


def timed_run(cmd, env):
    """Run ``cmd`` to its end; (the process, its wall seconds measured from here)."""
    tick = time.monotonic()
    proc = run(cmd, env, timeout=240)
    measured = time.monotonic() - tick
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, measured


def check(run_dir, proc, measured, ranks, spent=SPENT):
    """Everything the timings promise, from one launch."""
    t = result(run_dir)["timings"]
    missing = set(timings.PHASES) - set(t)
    assert not missing, f"phases missing: {missing}"
    phases = {k: t[k] for k in timings.PHASES}
    assert all(v >= 0 for v in phases.values()), phases
    assert sum(phases.values()) == pytest.approx(t["wall"], rel=0.05), t
    assert t["other"] <= 0.05 * t["wall"], t
    spent += ("agreement",) if ranks > 1 else ()
    assert [k for k in spent if phases[k] <= 0] == [], t
    # wall ends when result.json is written, before the process exits; the start of the
    # launch is read in clock ticks (10 ms), hence the margin above.
    assert 0.5 * measured <= t["wall"] <= measured + 0.01, (t["wall"], measured)
    assert t["training_share"] == pytest.approx(t["training"] / t["wall"], abs=1e-3)
    if ranks > 1:  # the wall starts with horovodrun
        assert t["since"] == "launcher" and t["launcher"] > 0, t
    else:
        assert t["since"] == "process" and t["launcher"] == 0, t
    lines = [line for line in proc.stdout.splitlines() if "hvdtrain: timings" in line]
    assert len(lines) == 1 and f"wall {t['wall']:.2f}" in lines[0], proc.stdout[-2000:]
    assert all(f"{k} " in lines[0] for k in timings.PHASES), lines[0]


@pytest.mark.parametrize("ranks", [1, 2])
def test_task_path_timings(ranks, env, tmp_path):
    run_dir = str(tmp_path / "run")
    args = ("--epochs", 2, "--no-download", "--verbose", 2, "--run-dir", run_dir)
    cmd = module_cmd("mnist", *args) if ranks == 1 else launch("gloo", 2, "mnist", *args)
    check(run_dir, *timed_run(cmd, env), ranks, SPENT + ("model",))


# Under Keras 2 on 2 ranks: the phases' hooks in Keras 2's fit; one process adds nothing there.
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.keras2)])
def test_fit_path_timings(ranks, tmp_path):
    code = usercode.write(tmp_path, {"timed_fit": FIT})
    run_dir = str(tmp_path / "run")
    cmd = ["python", str(code / "timed_fit.py"), run_dir]
    if ranks > 1:
        cmd = [HOROVODRUN, "-np", "2", "--gloo", *cmd]
    check(run_dir, *timed_run(cmd, usercode.env_with(code, tmp_path)), ranks)


@pytest.mark.quick
def test_phases_nest_and_add_up(monkeypatch):
    """Time goes to the innermost open phase; leave() closes phases left open inside; outside
    every phase it is the script's. (A clock read from a list: no sleeps.)"""
    ticks = iter([0.0, 1.0, 3.0, 4.0, 7.0, 8.0, 10.0, 11.0, 15.0])
    monkeypatch.setattr(timings, "_now", lambda: next(ticks))
    clock = timings.Clock()  # 0: hvdtrain's first code
    with clock.phase("training"):  # 1: script 1
        with clock.phase("checkpoints"):  # 3: training 2
            pass  # 4: checkpoints 1
        clock.enter("first_call")  # 7: training 3, and first_call left open
    # 8: first_call 1, closed with training
    depth = clock.enter("evaluation")  # 10: script 2
    clock.leave(depth)  # 11: evaluation 1
    t = clock.report()  # 15: script 4; a start at 0 s: not /proc's
    assert {k: t[k] for k in ("script", "training", "checkpoints", "first_call", "evaluation")} == {
        "script": 7,
        "training": 5,
        "checkpoints": 1,
        "first_call": 1,
        "evaluation": 1,
    }
    assert t["wall"] == 15 == sum(t[k] for k in timings.PHASES)
    assert (t["since"], t["launcher"], t["startup"]) == ("hvdtrain", 0, 0)
    assert t["training_share"] == pytest.approx(5 / 15, abs=1e-4)


@pytest.mark.quick
def test_launchers_are_recognised():
    assert timings.is_launcher(["/venv/bin/python", "/venv/bin/horovodrun", "-np", "2"])
    assert timings.is_launcher(["mpirun", "-np", "2", "python"])
    # horovodrun --mpi execs /bin/sh -c "mpirun ...": the same process, the same start
    assert timings.is_launcher(["/bin/sh", "-c", "mpirun --allow-run-as-root -np 2 python"])
    assert not timings.is_launcher(["/bin/sh", "-c", "env HOROVOD_RANK=0 python -m x"])
    assert not timings.is_launcher(["/venv/bin/python", "-m", "pytest"])
    mine, start, since = timings.launch_start()
    assert start <= mine <= timings._now() and since in ("process", "launcher")


# --- the cuts (docs/performance/startup.md, "Where a short run's time goes") -----------


@pytest.mark.quick
def test_horovodrun_transports_on_one_host_leave_libfabric_out():
    """horovodrun --mpi's "-mca btl ^openib" reaches each rank as OMPI_MCA_btl: on one host
    the ofi transport is left out too; across hosts, or a user's own value, is left alone."""

    def chosen(**environ):
        return horovod_setup._horovod_defaults(environ).get("OMPI_MCA_btl")

    one_host = dict(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    assert chosen(OMPI_MCA_btl="^openib", **one_host) == "^openib,ofi"
    assert (
        chosen(OMPI_MCA_btl="^openib", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_SIZE="2")
        is None
    )
    assert chosen(OMPI_MCA_btl="self,vader,ofi", **one_host) is None
    assert chosen(**one_host) is None


@pytest.mark.quick
def test_one_rank_skips_horovods_host_collectives():
    """A Horovod world of one rank (not elastic) answers its host collectives itself."""

    class Refuses:  # any call into Horovod fails the test
        def __getattr__(self, name):
            raise AssertionError(f"hvd.{name} called with one rank")

    world = distributed.World()
    world.__class__ = distributed.HorovodWorld
    world.hvd, world.elastic = Refuses(), False
    assert world.alone and world.broadcast_object({"a": 1}) == {"a": 1}
    assert world.allgather_object(3) == [3] and world.agree(lambda: 5) == 5
    assert list(world.allreduce_sum([1.0, 2.0])) == [1.0, 2.0]
    world.broadcast_variables([])
    world.barrier()
    world.elastic = True
    assert not world.alone


def test_exit_now_ends_as_python_would(tmp_path):
    """The command line's exit without the interpreter's teardown: the status, a non-daemon
    thread finished, the atexit handlers run, buffered output flushed."""
    script = textwrap.dedent("""
        import atexit, sys, threading
        from hvdtrain.cli import exit_now
        atexit.register(lambda: print("atexit ran"))
        threading.Thread(target=lambda: print("thread ran")).start()
        print("buffered", end=" ")
        sys.stderr.write("unflushed")
        exit_now(3)
    """)
    p = run([sys.executable, "-c", script], clean_env(tmp_path / "home", PYTHONUNBUFFERED=""))
    assert p.returncode == 3 and p.stderr == "unflushed", p.stderr
    assert sorted(p.stdout.split()) == ["atexit", "buffered", "ran", "ran", "thread"], p.stdout


def test_keras_import_defers_matplotlib_until_used(tmp_path):
    """Keras 3 imports matplotlib (pyplot, patches) at start-up for keras.visualization when
    matplotlib is installed: 0.5 s of CPU of each process's start. Under hvdtrain none of
    matplotlib loads then, whoever imports Keras (hvdtrain or the script itself); it loads at
    its first use, and works then. A script that imported matplotlib first keeps Keras' own.
    Python's garbage collector is off while they import, and on again after with what they
    made frozen (unless the script had turned it off)."""
    pytest.importorskip("matplotlib")
    script = textwrap.dedent("""
        import os, sys
        import numpy as np
        import hvdtrain
        if sys.argv[2] == "hvdtrain":
            from hvdtrain.compat import keras
            k = keras()
        else:  # the script's own import, after hvdtrain's
            import keras as k
        print(sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib") or "none")
        import gc
        print(gc.isenabled())  # the collector, off while TensorFlow and Keras imported, is on
        print(gc.get_freeze_count() > 100_000)  # and never passes over what they made
        path = os.path.join(sys.argv[1], sys.argv[2] + ".png")
        k.visualization.plot_image_gallery(np.random.rand(4, 8, 8, 3).astype("float32"),
                                           value_range=(0, 1), path=path)
        print(os.path.getsize(path) > 1000, "matplotlib.pyplot" in sys.modules)
        from keras.src.visualization import plot_bounding_box_gallery
        import matplotlib.patches
        print(plot_bounding_box_gallery.patches.Patch is matplotlib.patches.Patch)
    """)
    env = clean_env(tmp_path / "home", extras=True, MPLBACKEND="Agg")  # matplotlib there
    for importer in ("hvdtrain", "script"):
        p = run([sys.executable, "-c", script, str(tmp_path), importer], env)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.split() == ["none", "True", "True", "True", "True", "True"], (
            importer,
            p.stdout,
        )
    # A script that turned the collector off keeps it off.
    first = (
        "import gc, matplotlib.pyplot as plt, hvdtrain; gc.disable(); "
        "from hvdtrain.base.compat import keras; keras(); "
        "from keras.src.visualization import plot_image_gallery as g; "
        "print(g.plt is plt, gc.isenabled(), gc.get_freeze_count())"
    )
    p = run([sys.executable, "-c", first], env)
    assert (p.returncode, p.stdout) == (0, "True False 0\n"), p.stderr[-2000:]
