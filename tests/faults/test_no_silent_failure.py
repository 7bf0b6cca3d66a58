"""No silent wrong answer, no traceback, nothing lost: bad run directories, a busy or
finished run directory, divergence, a failing step, bad data through the command line; in
one process and under horovodrun -np 2. The watchdog's own hardening: test_watchdog.py."""

import json
import os
import re
import signal
import sys
import time

import numpy as np
import pytest

from conftest import HOROVODRUN, finish, launch, module_cmd, rank_pids, run, start, wait_for

LONG = [
    "--batch-size",
    "5",
    "--epochs",
    "40",
    "--learning-rate",
    "0.0005",
    "--verbose",
    "2",
    "--checkpoint-every",
    "50",
]


def ranks_output(stderr):
    """What the training processes printed: under horovodrun, the lines it tags with a rank
    (its own closing traceback is the launcher's; scripts/launch_local.sh removes it)."""
    tagged = [l for l in stderr.splitlines() if re.match(r"\[\d+\]<stderr>:", l)]
    return "\n".join(tagged) if "horovodrun" in stderr else stderr


def one_error_line(p, *fragments):
    out = ranks_output(p.stderr)
    lines = [l for l in out.splitlines() if "error:" in l]
    assert len(lines) == 1 and "Traceback" not in out, p.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("np_", [1, 2])
@pytest.mark.parametrize("kind", ["file", "under_file"])
def test_unusable_run_dir_is_one_line_before_anything(kind, np_, env, tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory\n")
    run_dir = blocker if kind == "file" else blocker / "run"
    cmd = (
        module_cmd("mnist", "--run-dir", str(run_dir), "--no-download")
        if np_ == 1
        else launch("gloo", 2, "mnist", "--run-dir", str(run_dir), "--no-download")
    )
    started = time.monotonic()
    p = run(cmd, env, timeout=120)
    assert p.returncode == (2 if np_ == 1 else 1), p.stderr  # horovodrun: 1 for any failure
    why = "is a file, not a directory" if kind == "file" else "which is a file"
    one_error_line(p, f"--run-dir={run_dir}", why)
    assert blocker.read_text() == "not a directory\n"
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("np_", [1, 2])
def test_a_finished_run_is_never_overwritten(np_, env, tmp_path):
    args = ["--run-dir", str(tmp_path), "--epochs", "2", "--checkpoint-every", "0"]
    first = run(module_cmd("linear", *args), env)
    assert first.returncode == 0, first.stderr
    # A finished run whose checkpoints were cleaned up: only its result remains.
    for name in os.listdir(tmp_path / "checkpoints"):
        os.unlink(tmp_path / "checkpoints" / name)
    before = (tmp_path / "result.json").read_bytes()
    again = run(
        module_cmd("linear", *args) if np_ == 1 else launch("gloo", 2, "linear", *args), env
    )
    assert again.returncode == (2 if np_ == 1 else 1)
    one_error_line(again, "holds a finished run (result.json)", "choose a new one")
    assert (tmp_path / "result.json").read_bytes() == before


def test_a_second_run_on_a_busy_run_dir_is_refused_and_a_killed_one_leaves_no_lock(env, tmp_path):
    run_dir = tmp_path / "run"
    first = start(launch("gloo", 2, "linear", "--run-dir", str(run_dir), *LONG), env)
    try:
        assert wait_for(lambda: (run_dir / "config.json").exists(), 120), "first run not up"
        second = run(module_cmd("linear", "--run-dir", str(run_dir), *LONG), env, timeout=120)
        assert second.returncode == 1
        line = one_error_line(second, f"{run_dir} is in use by another run (pid ")
        holder = int(line.split("(pid ")[1].split()[0])
        assert holder in rank_pids(str(run_dir)).values()  # rank 0 of the first run
        # The first run is untouched: it goes on and writes its own files only.
        assert first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # ... then dies without releasing anything
        finish(first, 30)
    for pid in rank_pids(str(run_dir)).values():
        os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not rank_pids(str(run_dir)), 30)
    assert (run_dir / ".lock").exists()  # the file stays, the lock died with its holder
    again = run(
        module_cmd(
            "linear", "--run-dir", str(run_dir), *LONG[:-4], "--epochs", "1", "--verbose", "0"
        ),
        env,
    )
    assert again.returncode == 0, again.stderr  # not blocked by the killed run


@pytest.mark.parametrize("np_", [1, 2])
def test_divergence_stops_with_exit_1_keeping_the_last_good_checkpoint(np_, env, tmp_path):
    # Full-batch GD at learning rate 50 on the linear task: the loss grows by orders of
    # magnitude per step and overflows float32 within a few dozen steps.
    args = [
        "--run-dir",
        str(tmp_path),
        "--learning-rate",
        "50",
        "--epochs",
        "500",
        "--checkpoint-every",
        "5",
        "--verbose",
        "2",
    ]
    p = run(module_cmd("linear", *args) if np_ == 1 else launch("gloo", 2, "linear", *args), env)
    assert p.returncode == 1, p.stderr
    line = one_error_line(p, "the loss became NaN or infinite at step ", "--no-stop-on-divergence")
    step = int(line.split("at step ")[1].split(":")[0])
    assert 1 < step < 500
    assert not (tmp_path / "result.json").exists()
    from hvdtrain.engine import checkpoint_file as C

    newest = C.list_checkpoints(str(tmp_path / "checkpoints"))[0]
    assert newest[0] < step and f"step {newest[0]}" in line
    meta, arrays = C.read(newest[1])
    assert all(np.isfinite(a).all() for a in arrays)  # the kept checkpoint is a good one
    for l in open(tmp_path / "metrics.jsonl"):  # every line stays valid JSON
        json.loads(l)


def test_training_on_after_divergence_writes_valid_json(env, tmp_path):
    args = [
        "--run-dir",
        str(tmp_path),
        "--learning-rate",
        "50",
        "--epochs",
        "100",
        "--no-stop-on-divergence",
        "--verbose",
        "0",
    ]
    p = run(module_cmd("linear", *args), env)
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "result.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    r = json.loads(text)
    assert r["final_loss"] is None and r["global_step"] == 100
    for l in open(tmp_path / "metrics.jsonl"):
        json.loads(l)


BAD_LABELS = '''
import numpy as np
import tensorflow as tf
import hvdtrain
from hvdtrain.data import Data


class BadLabels(hvdtrain.Task):
    """A user's classifier whose data holds a label (10) its 10-way output cannot take."""
    name = "bad_labels"
    defaults = dict(batch_size=8, epochs=1)

    def load_data(self, config, world):
        x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
        y = np.arange(64, dtype=np.int32) % 10
        y[40] = 10
        return Data(x, y)

    def build_model(self, config):
        k = hvdtrain.compat.keras()
        return k.Sequential([k.Input((4,)), k.layers.Dense(10)])

    def loss(self, y, pred):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=pred)
'''


BAD_MAP = (
    BAD_LABELS
    + '''

CALLS = [0]


def flaky(x, y):
    """A reader that fails on rank 1 after its first 150 records (the count's, then training's)."""
    CALLS[0] += 1
    if hvdtrain.distributed.current().rank == 1 and CALLS[0] > 150:
        raise ValueError(f"record {CALLS[0]} is unreadable")
    return x, y


class BadMap(BadLabels):
    name = "bad_map"
    defaults = dict(batch_size=8, epochs=3)

    def load_data(self, config, world):
        x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
        y = np.arange(64, dtype=np.int32) % 10
        ds = tf.data.Dataset.from_tensor_slices((x, y)).map(
            lambda a, b: tf.py_function(flaky, [a, b], [tf.float32, tf.int32]))
        return Data(ds.map(lambda a, b: (tf.ensure_shape(a, [4]), tf.ensure_shape(b, []))), None)
'''
)

FIT_BAD = """
import sys
import numpy as np
import tensorflow as tf
import hvdtrain.keras as hk
from hvdtrain.compat import keras
hk.init()
k = keras()
case, run_dir = sys.argv[1], sys.argv[2]
x = np.random.default_rng(0).random((64, 4)).astype("float32")
y = (np.arange(64) % 10).astype("int32")
model = k.Sequential([k.Input((4,)), k.layers.Dense(10)])
model.compile(optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
              loss=k.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
more = {}
if case == "labels":  # a label the 10-way output cannot take
    y[40] = 10
    train = hk.dataset(x, y, batch_size=8)
else:  # a reader that fails on rank 1 after its first 100 records (the count's, then training's)
    calls = [0]

    def flaky(a, b):
        calls[0] += 1
        if hk.rank() == 1 and calls[0] > 100:
            raise ValueError(f"record {calls[0]} is unreadable")
        return a, b
    ds = tf.data.Dataset.from_tensor_slices((x, y)).map(
        lambda a, b: tf.py_function(flaky, [a, b], [tf.float32, tf.int32]))
    train = ds.map(lambda a, b: (tf.ensure_shape(a, [4]), tf.ensure_shape(b, []))).batch(8)
    more = dict(sharded=True)
try:
    hk.fit(model, train, epochs=3, run_dir=run_dir, **more)
except hk.Error as e:
    sys.exit(hk.report_error(e))
"""


def the_cause_once(p, cause):
    """The one line naming the failed step, its rank and ``cause``, said once in all the
    job's output, no traceback from the ranks; (its step, its rank)."""
    said = [l for l in (p.stdout + p.stderr).splitlines() if cause in l]
    assert len(said) == 1 and "Traceback" not in ranks_output(p.stderr), p.stderr[-3000:]
    assert "Graph execution error" not in p.stderr + p.stdout
    found = re.search(r"error: training step (\d+) failed on rank (\d+): ", said[0])
    assert found, said[0]
    return int(found.group(1)), int(found.group(2))


@pytest.mark.parametrize("np_", [1, 2])
def test_a_failing_step_is_one_line_naming_the_rank(np_, env, tmp_path):
    (tmp_path / "bad_labels.py").write_text(BAD_LABELS)
    env = dict(env, PYTHONPATH=f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}")
    args = [
        "-m",
        "hvdtrain",
        "run",
        "bad_labels:BadLabels",
        "--run-dir",
        str(tmp_path / "r"),
        "--verbose",
        "0",
    ]
    cmd = (
        [sys.executable, *args]
        if np_ == 1
        else [HOROVODRUN, "-np", "2", "--gloo", sys.executable, *args]
    )
    p = run(cmd, env, timeout=120)
    assert p.returncode == 1, p.stderr
    step, rank = the_cause_once(
        p, "Received a label value of 10 which is outside the valid range of [0, 10)."
    )
    # The step and rank whose batch holds example 40 (the label 10): hvdtrain's data order.
    from hvdtrain.base.config import Config
    from hvdtrain.inputs.arrays import epoch_plan

    holds = [
        (k + 1, r)
        for r in range(np_)
        for k, rows in enumerate(epoch_plan(64, 8, r, np_, Config().seed, 0))
        if 40 in rows
    ]
    assert holds == [(step, rank)]
    assert not (tmp_path / "r" / "result.json").exists()


@pytest.mark.parametrize("path,case", [("task", "map"), ("fit", "labels"), ("fit", "map")])
def test_one_ranks_failing_step_names_its_cause_once_on_both_paths(path, case, env, tmp_path):
    """A label out of range, or a tf.data map function that raises, on rank 1 alone: rank 0
    says the op's own message (not "Graph execution error:"), the step and the rank, once."""
    (tmp_path / "bad_map.py").write_text(BAD_MAP)
    (tmp_path / "fit_bad.py").write_text(FIT_BAD)
    env = dict(env, PYTHONPATH=f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}")
    cmd = (
        [sys.executable, "-m", "hvdtrain", "run", "bad_map:BadMap", "--verbose", "0", "--run-dir"]
        if path == "task"
        else [sys.executable, tmp_path / "fit_bad.py", case]
    )
    p = run(
        [HOROVODRUN, "-np", "2", "--gloo", *map(str, cmd), str(tmp_path / "r")], env, timeout=120
    )
    assert p.returncode == 1, p.stderr[-3000:]
    if case == "map":
        step, rank = the_cause_once(p, "ValueError: record ")
        assert re.search(
            r"failed on rank 1: ValueError: record \d+ is unreadable \(in the "
            r"function given to tf.data's map\)$",
            p.stderr,
            re.M,
        ), p.stderr[-3000:]
    else:
        step, rank = the_cause_once(p, "Received a label value of 10 which is outside")
        from hvdtrain.inputs.arrays import epoch_plan  # hk.dataset's order: example 40's step, rank

        assert [
            (k + 1, r)
            for r in range(2)
            for k, rows in enumerate(epoch_plan(64, 8, r, 2, 0, 0))
            if 40 in rows
        ] == [(step, rank)]
    assert rank == 1 and 1 <= step <= 12  # 3 epochs of 4 steps
    assert not (tmp_path / "r" / "result.json").exists()


@pytest.mark.parametrize("np_", [1, 2])
def test_float_images_in_an_npz_are_refused_not_trained(np_, env, tmp_path):
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "mnist.npz",
        x_train=rng.random((100, 28, 28)),
        y_train=rng.integers(0, 10, 100),
        x_test=rng.random((20, 28, 28)),
        y_test=rng.integers(0, 10, 20),
    )
    args = ["--data-dir", str(tmp_path), "--run-dir", str(tmp_path / "r"), "--epochs", "1"]
    p = run(module_cmd("mnist", *args) if np_ == 1 else launch("gloo", 2, "mnist", *args), env)
    assert p.returncode == 1
    one_error_line(p, "mnist.npz: x_train are float64", "integers 0-255")
    assert not (tmp_path / "r").exists()
