"""Gradient accumulation: N micro-batches of b per update, one allreduce per update.

Both paths: the Task path's --accumulate-steps N and hk.DistributedOptimizer(opt,
backward_passes_per_step=N) in hk.fit. N micro-batches of b must give the weights of one
batch of N * b (SGD, mean loss) on 1 process and on 2 ranks under horovodrun; checkpoints and
SIGTERM stops fall on update boundaries (the accumulators empty), and a resume ends with the
uninterrupted run's weights. Bad values are one line.
"""

import json
import os
import signal
import textwrap

import numpy as np
import pytest

from conftest import (
    HOROVODRUN,
    KERAS2,
    checkpoints,
    clean_env,
    finish,
    launch,
    module_cmd,
    rank_pids,
    result,
    run,
    start,
    wait_for,
)
from hvdtrain.engine import checkpoint_file as C

# The linear task far from converged (lr 5e-4), so equal weights mean equal trajectories.
LINEAR = ["--epochs", "4", "--learning-rate", "0.0005", "--verbose", "0"]


def _linear(env, tmp_path, np_, name, *args):
    run_dir = tmp_path / name
    cmd = [*LINEAR, "--run-dir", str(run_dir), *args]
    p = run(
        module_cmd("linear", *cmd) if np_ == 1 else launch("gloo", np_, "linear", *cmd),
        env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return result(run_dir)


@pytest.mark.keras2
@pytest.mark.parametrize("np_", [1, 2])
def test_task_path_micro_batches_give_the_weights_of_one_batch(np_, env, tmp_path):
    """--batch-size 5 --accumulate-steps 4 against --batch-size 20: the same updates (a step
    is an update), the same examples in each, the same weights to 1e-5."""
    one = _linear(env, tmp_path, np_, "batch20", "--batch-size", "20")
    acc = _linear(env, tmp_path, np_, "micro5x4", "--batch-size", "5", "--accumulate-steps", "4")
    steps = 4 * (1000 // (20 * np_))
    assert acc["global_step"] == one["global_step"] == steps
    assert acc["global_batch_size"] == one["global_batch_size"] == 20 * np_
    assert acc["batch_size"] == 5 and acc["ranks_identical"] is True
    np.testing.assert_allclose(acc["weights"], one["weights"], atol=1e-5, rtol=0)
    assert abs(acc["bias"] - one["bias"]) < 1e-5
    assert abs(one["weights"][0] - 0.1) > 1e-2  # far from converged: trajectories matched
    with open(tmp_path / "micro5x4" / "config.json") as f:
        assert json.load(f)["accumulate_steps"] == 4


# Keras 3 only: where the Task path's checkpoints and stops fall is hvdtrain's loop, the same
# under either Keras (its micro-batches' weights under Keras 2: the test above; the fit path's
# accumulation, which is Horovod's under Keras 2: test_fit_path_sigterm_... below).
def test_task_path_sigterm_and_checkpoints_on_updates_and_exact_resume(env, tmp_path):
    """2 ranks, 4 micro-batches of 5 per update (25 updates an epoch), a checkpoint every 10
    updates: each checkpoint's data position is a whole number of updates; rank 1's SIGTERM
    stops both ranks after an update with a checkpoint there; the rerun ends with the
    uninterrupted run's weights."""
    args = [
        "--batch-size",
        "5",
        "--accumulate-steps",
        "4",
        "--checkpoint-every",
        "10",
        "--keep-checkpoints",
        "1000",
        "--epochs",
        "20",
        "--learning-rate",
        "0.0005",
        "--steps-per-execution",
        "1",
        "--verbose",
        "0",
    ]
    whole = tmp_path / "whole"
    p = run(launch("gloo", 2, "linear", "--run-dir", str(whole), *args), env, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = result(whole)
    assert ref["global_step"] == 20 * 25
    steps = sorted(s for s, _ in checkpoints(whole))
    assert steps == sorted(set(range(10, 501, 10)) | set(range(25, 501, 25)))
    for step, path in checkpoints(whole)[:8]:
        meta, _ = C.read(path)
        assert meta["offset"] == (step - 25 * meta["epoch"]) * 40 and meta["offset"] < 1000

    cut = tmp_path / "cut"
    cmd = launch("gloo", 2, "linear", "--run-dir", str(cut), *args)
    proc = start(cmd, env)
    try:
        pids = wait_for(lambda: (lambda d: d if len(d) == 2 else None)(rank_pids(str(cut))), 120)
        assert pids and wait_for(lambda: checkpoints(cut), 120)
        os.kill(pids[1], signal.SIGTERM)
        rc, out, err = finish(proc, 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc not in (None, 0), err[-3000:]
    message = [l for l in err.splitlines() if "stopped by SIGTERM at step" in l]
    assert len(message) == 1, err[-3000:]
    stopped = int(message[0].split("at step ")[1].split(";")[0])
    assert 0 < stopped < 500 and checkpoints(cut)[0][0] == stopped
    meta, _ = C.read(checkpoints(cut)[0][1])
    assert meta["offset"] == (stopped - 25 * meta["epoch"]) * 40  # whole updates
    p = run(cmd, env, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"step {stopped}" in p.stderr
    r = result(cut)
    assert r["global_step"] == 500 and r["ranks_identical"] is True
    np.testing.assert_allclose(r["weights"], ref["weights"], atol=1e-6, rtol=0)
    assert abs(r["bias"] - ref["bias"]) < 1e-6


# argv: run_dir batch passes steps_per_execution checkpoint_every [term]. 960 examples of 8
# features, 3 classes; term: the last rank sends itself SIGTERM when the first call ends.
FIT = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import hvdtrain.keras as hk
    from hvdtrain.compat import keras

    hk.init()
    k = keras()
    run_dir, (batch, passes, spe, every), mode = sys.argv[1], map(int, sys.argv[2:6]), sys.argv[6:]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((960, 8)).astype("float32")
    y = x[:, :3].argmax(1).astype("int64")

    class Term(k.callbacks.Callback):
        def on_train_batch_end(self, b, logs=None):
            if hk.rank() == hk.size() - 1 and not getattr(self, "sent", False):
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

    k.utils.set_random_seed(0)
    model = k.Sequential([k.Input((8,)), k.layers.Dense(16, activation="tanh"),
                          k.layers.Dense(3, activation="softmax")])
    try:
        opt = hk.DistributedOptimizer(k.optimizers.SGD(0.5), backward_passes_per_step=passes)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False,
                      steps_per_execution=spe)
        hk.fit(model, hk.dataset(x, y, batch_size=batch, seed=1), epochs=2, run_dir=run_dir,
               checkpoint_every=every, keep_checkpoints=100, verbose=2,
               callbacks=[Term()] if mode == ["term"] else [])
    except hk.Error as e:
        sys.exit(hk.report_error(e))
""")


@pytest.fixture
def fit_script(tmp_path):
    path = tmp_path / "accumulate_fit.py"
    path.write_text(FIT)
    return path


def _fit(script, tmp_path, np_, name, batch, passes, spe=1, every=0, *mode, ok=True):
    import sys

    run_dir = str(tmp_path / name)
    cmd = [sys.executable, str(script), run_dir, *map(str, (batch, passes, spe, every)), *mode]
    if np_ > 1:
        cmd = [HOROVODRUN, "-np", str(np_), "--gloo", *cmd]
    p = run(cmd, clean_env(tmp_path / "home"), timeout=300)
    if ok:
        assert p.returncode == 0, p.stderr[-3000:]
    return run_dir, p


def saved_weights(run_dir):
    from hvdtrain.compat import keras

    model = keras().models.load_model(os.path.join(run_dir, "model.keras"), compile=False)
    return [np.asarray(w) for w in model.get_weights()]


@pytest.mark.keras2
@pytest.mark.parametrize("np_", [1, 2])
def test_fit_path_micro_batches_give_the_weights_of_one_batch(np_, fit_script, tmp_path):
    """backward_passes_per_step=4 over batches of 8 against batches of 32: the same global
    step (updates), the same weights to 1e-5; with steps_per_execution 5, calls that end
    inside updates."""
    one, _ = _fit(fit_script, tmp_path, np_, "batch32", 32, 1)
    acc, _ = _fit(fit_script, tmp_path, np_, "micro8x4", 8, 4, 5)
    a, b = result(one), result(acc)
    assert a["global_step"] == b["global_step"] == 2 * 960 // (32 * np_)
    assert a["global_batch_size"] == b["global_batch_size"] == 32 * np_
    assert b["ranks_identical"] is True
    for x, y in zip(saved_weights(one), saved_weights(acc)):
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)
    with open(os.path.join(acc, "config.json")) as f:
        assert json.load(f)["accumulate_steps"] == 4
    for r, s in zip(_metrics(one), _metrics(acc)):
        assert r["global_step"] == s["global_step"]
        assert s["loss"] == pytest.approx(r["loss"], abs=1e-5)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.keras2
def test_fit_path_sigterm_and_checkpoints_on_updates_and_exact_resume(fit_script, tmp_path):
    """2 ranks, 4 micro-batches of 8 per update (60 Keras steps, 15 updates an epoch), calls
    of 5 steps, a checkpoint every 2 updates: calls end on an update only every 20 steps, so
    each checkpoint waits for the first call that ends on one (updates 5, 10, ...), and so
    does rank 1's SIGTERM, seen at step 10 (update 2.5) and acted on at step 20 (update 5).
    The rerun ends with the uninterrupted run's weights."""
    whole, _ = _fit(fit_script, tmp_path, 2, "whole", 8, 4, 5, 2)
    assert result(whole)["global_step"] == 30
    assert sorted(s for s, _ in C.list_checkpoints(os.path.join(whole, "checkpoints"))) == [
        5,
        10,
        15,
        20,
        25,
        30,
    ]
    for step, path in C.list_checkpoints(os.path.join(whole, "checkpoints")):
        meta, _ = C.read(path)
        assert meta["offset"] % (8 * 2 * 4) == 0  # whole updates
        assert meta["offset"] == (step - 15 * meta["epoch"]) * 64
    cut, p = _fit(fit_script, tmp_path, 2, "cut", 8, 4, 5, 2, "term", ok=False)
    assert p.returncode == 1 and "Exit code: 75" in p.stderr, p.stderr[-3000:]
    assert "stopped by SIGTERM at step 5" in p.stderr, p.stderr[-3000:]
    assert [s for s, _ in C.list_checkpoints(os.path.join(cut, "checkpoints"))] == [5]
    _, p = _fit(fit_script, tmp_path, 2, "cut", 8, 4, 5, 2)
    assert "step 5" in p.stderr
    assert result(cut)["global_step"] == 30 and result(cut)["ranks_identical"] is True
    for x, y in zip(saved_weights(whole), saved_weights(cut)):
        assert float(np.abs(x - y).max()) < 1e-6


@pytest.mark.parametrize("value", ["0", "-2"])
def test_task_path_bad_accumulate_steps_is_one_line(value, env):
    p = run(module_cmd("linear", "--accumulate-steps", value, "--epochs", "1"), env)
    assert p.returncode == 2
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert lines == [
        f"python -m hvdtrain.linear: error: --accumulate-steps={value}: must be "
        "at least 1 (1: no accumulation)"
    ], p.stderr


def test_task_path_too_many_micro_batches_is_one_line(env, tmp_path):
    p = run(
        module_cmd(
            "linear",
            "--batch-size",
            "100",
            "--accumulate-steps",
            "20",
            "--epochs",
            "1",
            "--run-dir",
            str(tmp_path / "r"),
        ),
        env,
    )
    assert p.returncode == 2, p.stderr
    errors = [l for l in p.stderr.splitlines() if "error" in l]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    assert (
        "--accumulate-steps=20: 20 micro-batches of 100 x 1 workers need more than the "
        "1000 training examples"
    ) in errors[0]


@pytest.mark.parametrize(
    "batch, passes, why",
    [
        (8, 7, "hk.fit(backward_passes_per_step=7): must divide the 120 steps of an epoch"),
        (8, 0, "--backward-passes-per-step=0: must be an integer, at least 1"),
    ],
)
def test_fit_path_bad_backward_passes_is_one_line(batch, passes, why, fit_script, tmp_path):
    _, p = _fit(fit_script, tmp_path, 1, "bad", batch, passes, ok=False)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert why in p.stderr, p.stderr[-3000:]


@pytest.mark.keras2
def test_task_path_one_negotiation_round_per_update(env, tmp_path):
    """4 micro-batches per update: the gradients and the [stop, diverged] flags still travel
    in one grouped allreduce per update (a Horovod timeline of a real 2-process run)."""
    from hvdtrain.bench.cases import read_timeline, summarize_timeline

    timeline = tmp_path / "timeline.json"
    p = run(
        launch(
            "mpi",
            2,
            "mnist",
            "--epochs",
            "2",
            "--batch-size",
            "25",
            "--accumulate-steps",
            "4",
            "--checkpoint-every",
            "0",
            "--verbose",
            "0",
            "--run-dir",
            str(tmp_path / "r"),
        ),
        dict(env, HOROVOD_TIMELINE=str(timeline)),
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = result(tmp_path / "r")
    steps = r["global_step"]
    assert steps == 2 * 4000 // (100 * 2) and r["global_batch_size"] == 200
    events = read_timeline(str(timeline))
    tensors = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("name") == "process_name" and "name" in e.get("args", {})
    }
    grouped = sorted(t for t in tensors.values() if "GroupedAllreduce" in t)
    assert [t[-4:] for t in grouped] == ["1of3", "2of3", "3of3"], tensors
    negotiated = [
        tensors[e["pid"]]
        for e in events
        if e.get("ph") == "B" and e.get("name") == "NEGOTIATE_ALLREDUCE"
    ]
    assert all(negotiated.count(t) == steps for t in grouped)  # per update, not micro-batch
    # Between the first step and the last, 4 host rounds per epoch: the metric sums, the
    # epoch record's and the checkpoint's write checks, the ranks' agreement before it
    # (World.any_true, World.all_same); in the whole run 14 more (the start's and the end's
    # agreement questions, the final scoring): not one per step.
    rounds = summarize_timeline(str(timeline))
    assert steps < rounds["training_rounds"] <= steps + 4 * 2, rounds
    assert rounds["allreduce_rounds"] <= steps + 4 * 2 + 16 < 2 * steps, rounds


@pytest.mark.keras2
def test_task_path_streamed_micro_batches_train_like_in_memory(tmp_path):
    """Arrays on disk (streamed: each update's rows read as one block, split in the step)
    and in memory give the same bits with 4 micro-batches of 4; and the weights of batches
    of 16 to 1e-5 (SGD with momentum: the same mean gradient, the same update)."""
    import hvdtrain
    from hvdtrain import distributed
    from xor_task import OnDisk, Xor

    world = distributed.init("auto")
    args = dict(learning_rate=0.5, momentum=0.9, epochs=5, verbose=0, num_workers=1)

    def train(task, name, **more):
        config = hvdtrain.Config(run_dir=str(tmp_path / name), **args, **more)
        return hvdtrain.train(task, config, world), hvdtrain.compat.keras().models.load_model(
            tmp_path / name / "model.keras", compile=False
        ).get_weights()

    (a, wa), (b, _) = (
        train(Xor(), "mem", batch_size=4, accumulate_steps=4),
        train(OnDisk(str(tmp_path)), "disk", batch_size=4, accumulate_steps=4),
    )
    assert a["weights_sha256"] == b["weights_sha256"]
    assert a["global_step"] == b["global_step"] == 5 * 256 // 16
    one, w1 = train(Xor(), "one", batch_size=16)
    assert one["global_step"] == a["global_step"]
    for x, y in zip(w1, wa):
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)
    assert abs(one["final_loss"] - a["final_loss"]) < 1e-5


@pytest.mark.skipif(KERAS2, reason="Keras 2's accumulation is Horovod's own wrapper")
def test_fit_path_one_gradient_round_per_update(fit_script, tmp_path):
    """Keras 3 (hvdtrain's wrapper over Keras' own accumulation): 120 Keras steps of 8 on
    2 ranks, 4 per update: the gradients' grouped allreduce (4 gradients and the stop flags,
    optimizer.StopFlags) is negotiated 30 times, once per update, not per micro-batch (a
    Horovod timeline of the real run)."""
    import sys

    from hvdtrain.bench.cases import read_timeline

    timeline = tmp_path / "timeline.json"
    cmd = [
        HOROVODRUN,
        "-np",
        "2",
        "--mpi",
        sys.executable,
        str(fit_script),
        str(tmp_path / "r"),
        "8",
        "4",
        "1",
        "0",
    ]
    p = run(cmd, clean_env(tmp_path / "home", HOROVOD_TIMELINE=str(timeline)), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert result(tmp_path / "r")["global_step"] == 30
    events = read_timeline(str(timeline))
    tensors = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("name") == "process_name" and "name" in e.get("args", {})
    }
    grouped = sorted(t for t in tensors.values() if "GroupedAllreduce" in t)
    assert [t[-4:] for t in grouped] == [f"{i}of5" for i in range(1, 6)], tensors
    negotiated = [
        tensors[e["pid"]]
        for e in events
        if e.get("ph") == "B" and e.get("name") == "NEGOTIATE_ALLREDUCE"
    ]
    assert [negotiated.count(t) for t in grouped] == [30] * 5


def test_task_path_resume_with_other_accumulate_steps_is_refused(env, tmp_path):
    """N defines the run (each update's batch): a checkpoint made with another N is refused
    in one line naming the change."""
    args = ["--batch-size", "10", "--epochs", "1", "--verbose", "0", "--run-dir", str(tmp_path)]
    p = run(module_cmd("linear", *args, "--accumulate-steps", "2"), env)
    assert p.returncode == 0, p.stderr
    assert result(tmp_path)["global_step"] == 50
    p = run(module_cmd("linear", *args[:3], "2", *args[4:], "--accumulate-steps", "4"), env)
    assert p.returncode == 1
    errors = [l for l in p.stderr.splitlines() if "error:" in l]
    assert len(errors) == 1 and "--accumulate-steps 2 -> 4" in errors[0], p.stderr
