"""Real models on 2 ranks (horovodrun --gloo), both paths: BatchNormalization's moving
statistics averaged over the ranks (ranks identical, the saved model is the one evaluated).

A small BN classifier on synthetic data; each test bounds its processes' time.
"""

import json
import os
import textwrap

import numpy as np
import pytest

import usercode
from conftest import result, run
from hvdtrain.engine import checkpoint_file as C

# The data, the model and the Task (tests/usercode.py), shared with the SyncBN tests.
COMMON = usercode.bn_common()
TASK = usercode.bn_task("bn", learning_rate=0.05, batch_size=16, epochs=2, checkpoint_every=5)
# argv: run_dir [steps_per_execution [checkpoint_every [mode]]]; mode "term": rank 1 sends
# itself SIGTERM when the first compiled call ends; "term-horovod": the same, the optimizer
# wrapped by Horovod's own DistributedOptimizer (horovod.tensorflow.keras), which hvdtrain's
# stop flags do not ride in; "backup": a BackupAndRestore;
# "callbacks": Keras' file-writing callbacks, ReduceLROnPlateau, EarlyStopping, Record.
FIT = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import hvdtrain.keras as hk
    from hvdtrain.compat import keras
    import common

    hk.init()
    x, y, x_test, y_test = common.data()
    spe = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    every = int(sys.argv[3]) if len(sys.argv) > 3 else 5

    class Term(keras().callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if hk.rank() == 1 and not getattr(self, "sent", False):
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

    class Record(keras().callbacks.Callback):  # what a user's callback sees, per rank
        def on_epoch_end(self, epoch, logs=None):
            lr = float(np.asarray(self.model.optimizer.learning_rate))
            with open(os.path.join(sys.argv[1] + ".ranks", f"rank{hk.rank()}.jsonl"), "a") as f:
                print(json.dumps({**{k: float(v) for k, v in logs.items()
                                     if k in ("loss", "val_loss", "val_accuracy")}, "lr": lr}),
                      file=f)

    def per_rank(name):  # each rank's own path: shows which ranks ran the callback
        return os.path.join(sys.argv[1] + ".ranks", f"{name}{hk.rank()}")

    mode, callbacks, epochs = sys.argv[4:5], [], 2
    if mode in (["term"], ["term-horovod"]):
        callbacks = [Term()]
    elif mode == ["backup"]:
        callbacks = [keras().callbacks.BackupAndRestore(per_rank("backup"))]
    elif mode == ["callbacks"]:
        os.makedirs(sys.argv[1] + ".ranks", exist_ok=True)
        epochs = 4  # EarlyStopping ends it after 2
        callbacks = [keras().callbacks.CSVLogger(per_rank("log") + ".csv"),
                     keras().callbacks.TensorBoard(per_rank("tb")),
                     keras().callbacks.ModelCheckpoint(per_rank("ckpt") + ".keras"),
                     keras().callbacks.ReduceLROnPlateau("val_loss", 0.5, patience=0,
                                                         min_delta=10),
                     keras().callbacks.EarlyStopping("val_loss", min_delta=10, patience=1),
                     Record()]
    model = common.model()
    if mode == ["term-horovod"]:
        import horovod.tensorflow.keras as hvd
        optimizer = hvd.DistributedOptimizer(keras().optimizers.SGD(0.05))
    else:
        optimizer = hk.DistributedOptimizer(keras().optimizers.SGD(0.05))
    model.compile(optimizer=optimizer,
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  steps_per_execution=spe)
    try:
        hk.fit(model, hk.dataset(x, y, batch_size=16, seed=1), epochs=epochs,
               validation_data=(x_test, y_test), run_dir=sys.argv[1], checkpoint_every=every,
               verbose=2, callbacks=callbacks)
    except hk.Error as e:
        sys.exit(hk.report_error(e))
""")


@pytest.fixture
def code(tmp_path):
    return usercode.write(tmp_path, {"common": COMMON, "bn_task": TASK, "bn_fit": FIT})


env_with = usercode.env_with


def two_ranks(cmd):
    return usercode.two_ranks(*cmd)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def saved_model_accuracy(code, run_dir):
    """model.keras loaded in this one process, scored on the whole test set."""
    import sys

    sys.path.insert(0, str(code))
    try:
        import common

        from hvdtrain.compat import keras

        _, _, x_test, y_test = common.data()
    finally:
        sys.path.remove(str(code))
    model = keras().models.load_model(os.path.join(run_dir, "model.keras"), compile=False)
    pred = np.asarray(model.predict(x_test, batch_size=len(x_test), verbose=0))
    return float(np.mean(pred.argmax(-1) == y_test)), model


def moving_stats(model):
    bn = [l for l in model.layers if "batch_normalization" in l.name][0]
    return [np.asarray(w) for w in bn.get_weights()[2:]]  # moving mean, moving variance


@pytest.mark.keras2
def test_batchnorm_task_two_ranks_identical_and_the_saved_model_is_the_one_scored(code, tmp_path):
    run_dir = str(tmp_path / "task")
    p = run(
        two_ranks(["-m", "hvdtrain", "run", "bn_task:BN", "--run-dir", run_dir]),
        env_with(code, tmp_path),
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = result(run_dir)
    assert res["ranks_identical"] is True and "differ from rank 0" not in p.stderr
    accuracy, model = saved_model_accuracy(code, run_dir)
    assert res["test_examples"] == 288
    assert res["test_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert res["test_accuracy"] > 0.7
    mean, var = moving_stats(model)
    assert np.abs(mean).max() > 0.1 and not np.allclose(var, 1.0)  # the statistics moved


@pytest.mark.keras2
def test_batchnorm_fit_two_ranks_identical_and_the_saved_model_is_the_one_scored(code, tmp_path):
    run_dir = str(tmp_path / "fit")
    p = run(two_ranks([code / "bn_fit.py", run_dir]), env_with(code, tmp_path), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    res = result(run_dir)
    assert res["ranks_identical"] is True and "differ from rank 0" not in p.stderr
    accuracy, model = saved_model_accuracy(code, run_dir)
    last = metrics(run_dir)[-1]
    # Keras keeps the metric in float32; one example of 288 is 3e-3.
    assert last["val_accuracy"] == pytest.approx(accuracy, abs=1e-6) and accuracy > 0.7
    mean, var = moving_stats(model)
    assert np.abs(mean).max() > 0.1 and not np.allclose(var, 1.0)


def fit_two_ranks(code, tmp_path, run_dir, *args, ok=True):
    p = run(two_ranks([code / "bn_fit.py", run_dir, *args]), env_with(code, tmp_path), timeout=180)
    if ok:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def saved_weights(run_dir):
    from hvdtrain.compat import keras

    model = keras().models.load_model(os.path.join(run_dir, "model.keras"), compile=False)
    return [np.asarray(w) for w in model.get_weights()]


@pytest.mark.keras2
def test_fit_steps_per_execution_8_gives_the_weights_of_1(code, tmp_path):
    """compile(steps_per_execution=8): 16 steps an epoch in calls of 8; checkpoints every 8
    steps, so the statistics are averaged at the same steps as with 1: the same bits."""
    one, eight = str(tmp_path / "spe1"), str(tmp_path / "spe8")
    fit_two_ranks(code, tmp_path, one, 1, 8)
    fit_two_ranks(code, tmp_path, eight, 8, 8)
    a, b = result(one), result(eight)
    assert a["global_step"] == b["global_step"] == 32
    assert a["ranks_identical"] and b["ranks_identical"]
    assert a["weights_sha256"] == b["weights_sha256"]
    for r, s in zip(metrics(one), metrics(eight)):
        assert r["global_step"] == s["global_step"]
        for k in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert s[k] == pytest.approx(r[k], abs=1e-6), (r["epoch"], k)
    with open(os.path.join(eight, "config.json")) as f:
        assert json.load(f)["steps_per_execution"] == 8
    steps = [s for s, _ in C.list_checkpoints(os.path.join(eight, "checkpoints"))]
    assert steps == [32, 24, 16]


@pytest.mark.keras2
def test_fit_steps_per_execution_3_sigterm_checkpoints_and_exact_resume(code, tmp_path):
    """Calls of 3 steps (16 an epoch: the last call is 1 step), checkpoint_every 5: each
    checkpoint at the first call boundary at or after a multiple of 5; rank 1's SIGTERM
    after the first call rides in the next calls' updates and is read at the first
    boundary past 10 steps (12), where every rank stops with a checkpoint; the rerun ends
    with the uninterrupted run's weights, steps and metrics. With Horovod's own
    DistributedOptimizer (which hk.fit takes under either Keras) the flags cannot ride, and
    a host check stops every rank at the same step."""
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    fit_two_ranks(code, tmp_path, whole, 3, 5)
    # Epoch 2's calls end at steps 19, 22, 25, 28, 31, 32: past 20, at 25, past 30, the end.
    assert [s for s, _ in C.list_checkpoints(os.path.join(whole, "checkpoints"))] == [
        32,
        31,
        25,
    ]  # the newest 3 kept
    p = fit_two_ranks(code, tmp_path, cut, 3, 5, "term", ok=False)
    assert p.returncode == 1 and "Exit code: 75" in p.stderr, p.stderr[-3000:]
    assert "stopped by SIGTERM at step 12" in p.stderr, p.stderr[-3000:]
    assert [s for s, _ in C.list_checkpoints(os.path.join(cut, "checkpoints"))] == [12, 6]
    p = fit_two_ranks(code, tmp_path, cut, 3, 5)
    assert "step 12" in p.stderr
    assert result(cut)["global_step"] == result(whole)["global_step"] == 32
    for x, y in zip(saved_weights(whole), saved_weights(cut)):
        assert float(np.abs(x - y).max()) < 1e-6
    for r, s in zip(metrics(whole), metrics(cut)):
        for k in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert s[k] == pytest.approx(r[k], abs=1e-5), (r["epoch"], k)
    records = metrics(whole)
    assert [r["global_step"] for r in records] == [16, 32] and len(metrics(cut)) == 2
    assert records[1]["loss"] < records[0]["loss"]  # epoch 2's own metrics
    # Horovod's own wrapper reduces the gradients without hvdtrain's flags: the calls carry
    # none, and a host allreduce at the same boundary stops every rank.
    horovods = str(tmp_path / "horovods")
    p = fit_two_ranks(code, tmp_path, horovods, 3, 5, "term-horovod", ok=False)
    assert p.returncode == 1 and "Exit code: 75" in p.stderr, p.stderr[-3000:]
    assert "stopped by SIGTERM at step 12" in p.stderr, p.stderr[-3000:]
    assert [s for s, _ in C.list_checkpoints(os.path.join(horovods, "checkpoints"))] == [12, 6]


@pytest.mark.keras2
def test_fit_file_callbacks_on_rank_0_only_and_lr_plateau_early_stopping_see_global_metrics(
    code, tmp_path
):
    """CSVLogger, TensorBoard, ModelCheckpoint run on rank 0 alone; ReduceLROnPlateau and
    EarlyStopping (and any callback after hvdtrain's) see the metrics over every rank, so
    every rank lowers the rate and stops at the same epoch (one alone would hang the others)."""
    run_dir = str(tmp_path / "cb")
    fit_two_ranks(code, tmp_path, run_dir, 1, 8, "callbacks")
    ranks = run_dir + ".ranks"
    written = sorted(os.listdir(ranks))
    assert written == ["ckpt0.keras", "log0.csv", "rank0.jsonl", "rank1.jsonl", "tb0"], written
    seen = []
    for r in (0, 1):
        with open(os.path.join(ranks, f"rank{r}.jsonl")) as f:
            seen.append([json.loads(line) for line in f])
    records = metrics(run_dir)
    assert len(records) == len(seen[0]) == 2  # EarlyStopping: 2 epochs of 4, every rank
    assert seen[0] == seen[1]  # the same logs on both ranks ...
    for got, record in zip(seen[0], records):  # ... and they are metrics.jsonl's, global
        for k in ("loss", "val_loss", "val_accuracy"):
            assert got[k] == pytest.approx(record[k], abs=1e-6), k
    assert [s["lr"] for s in seen[0]] == pytest.approx([0.05, 0.025])
    res = result(run_dir)
    assert res["global_step"] == 32 and res["ranks_identical"] is True


def test_fit_backup_and_restore_is_refused_in_one_line(code, tmp_path):
    p = fit_two_ranks(code, tmp_path, str(tmp_path / "b"), 1, 8, "backup", ok=False)
    assert p.returncode != 0 and "Exit code: 2" in p.stderr  # horovodrun names rank 0's
    lines = [l for l in p.stderr.splitlines() if "BackupAndRestore" in l]
    assert lines and "not for hk.fit: hk.fit checkpoints and resumes by itself" in lines[0], (
        p.stderr[-2000:]
    )
    assert len(lines) == 1  # said once (rank 0), no traceback from the ranks
