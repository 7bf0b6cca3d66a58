"""The model.fit path (hvdtrain.keras) through the real launcher, on examples/keras_fit_mnist.py.

Small dense model, bundled MNIST sample, few epochs: each test bounds its processes' time.
"""

import json
import math
import os
import signal

import numpy as np
import pytest

from conftest import (
    ROOT,
    as_printed,
    checkout_like,
    finish,
    launch_example,
    rank_pids,
    result,
    run,
    script_cmd,
    start,
    wait_for,
)
from docs_pages import block, docs_text
from hvdtrain.engine import checkpoint_file as C

EXAMPLE = "keras_fit_mnist.py"
DENSE = ("--model", "dense")


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def weights(run_dir):
    from hvdtrain.compat import keras

    model = keras().models.load_model(os.path.join(run_dir, "model.keras"), compile=False)
    return model, [np.asarray(w) for w in model.get_weights()]


def fit(env, np_, run_dir, *args, timeout=150):
    proc = run(launch_example(np_, EXAMPLE, *DENSE, "--run-dir", run_dir, *args), env, timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.keras2
@pytest.mark.quick
def test_example_two_ranks_and_one_identical_weights_and_run_dir(env, tmp_path):
    """(a) np=2 and np=1 both train; the two ranks end with the same weights (digests). The
    one process is the README's one-process command, as printed."""
    one = block("README.md", "horovodrun -np 2 python examples/keras_fit_mnist.py").commands()[1]
    assert one == "python examples/keras_fit_mnist.py --epochs 1 --model dense"
    for np_ in (2, 1):
        if np_ == 2:
            run_dir, epochs, batch = str(tmp_path / "np2"), 2, 64
            # The example compiled with jit_compile=True (what Keras 3's "auto" is on a GPU):
            # the step runs without XLA, said once (Horovod's ops have no XLA kernels).
            source = open(os.path.join(ROOT, "examples", EXAMPLE)).read()
            assert source.count("jit_compile=False") == 1
            script = tmp_path / "keras_fit_mnist_xla.py"
            script.write_text(source.replace("jit_compile=False", "jit_compile=True"))
            proc = run(
                script_cmd(
                    2,
                    str(script),
                    *DENSE,
                    "--run-dir",
                    run_dir,
                    "--epochs",
                    epochs,
                    "--batch-size",
                    batch,
                ),
                env,
                150,
            )
        else:  # its defaults: a batch of 128, run dir runs/keras_fit_mnist
            cwd = checkout_like(tmp_path / "np1")
            proc = run(as_printed(one), env, 150, cwd=str(cwd))
            run_dir, epochs, batch = str(cwd / "runs" / "keras_fit_mnist"), 1, 128
        assert proc.returncode == 0, proc.stderr[-3000:]
        said = (proc.stdout + proc.stderr).count("jit_compile turned off")
        assert said == (1 if np_ == 2 else 0), proc.stderr[-3000:]
        res = result(run_dir)
        assert res["world_size"] == np_ and res["ranks_identical"] is True
        assert res["global_step"] == epochs * (4000 // (batch * np_))
        records = metrics(run_dir)
        assert [r["epoch"] for r in records] == list(range(1, epochs + 1))
        assert records[-1]["val_accuracy"] > 0.7 and records[-1]["val_loss"] < math.log(10)
        assert epochs == 1 or records[-1]["loss"] < records[0]["loss"]
        # Only rank 0 prints: one line per epoch in a pipe.
        assert proc.stdout.count(f"Epoch {epochs}/{epochs}") == 1, proc.stdout
        assert os.listdir(os.path.join(run_dir, "tensorboard"))
        assert C.list_checkpoints(os.path.join(run_dir, "checkpoints"))[0][0] == res["global_step"]
        model, _ = weights(run_dir)  # model.keras opens with plain load_model
        assert model.count_params() == 7850


def test_the_readme_two_process_fit_command_as_printed(env, tmp_path):
    """The README's (and the Keras fit guide's) first fit command, as printed: the example's
    conv net, 5 epochs on two ranks, the run directory it names."""
    two = block("README.md", "horovodrun -np 2 python examples/keras_fit_mnist.py").commands()[0]
    assert (
        two == "horovodrun -np 2 python examples/keras_fit_mnist.py --epochs 5 --run-dir runs/fit"
    )
    cwd = checkout_like(tmp_path)
    proc = run(as_printed(two), env, 240, cwd=str(cwd))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = str(cwd / "runs" / "fit")
    res = result(run_dir)
    assert (res["world_size"], res["ranks_identical"]) == (2, True)
    assert res["global_step"] == 5 * (4000 // (128 * 2))  # the example's batch, per rank
    records = metrics(run_dir)
    assert [r["epoch"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-1]["loss"] < records[0]["loss"] and records[-1]["val_accuracy"] > 0.9
    assert proc.stdout.count("Epoch 5/5") == 1, proc.stdout  # rank 0 alone
    assert sorted(n for n in os.listdir(run_dir) if not n.startswith(".")) == [  # .lock
        "checkpoints",
        "config.json",
        "metrics.jsonl",
        "model.keras",
        "result.json",
        "tensorboard",
    ]
    model, _ = weights(run_dir)
    assert any("conv" in layer.name for layer in model.layers)


# Keras 3 only: under Keras 2 the fit path's 2 ranks = 1 process at the same global batch is
# test_sync_bn's (BN model, weights to 1e-6) and test_keras_fit_patterns' (Adam and an
# embedding), its global epoch metrics test_epoch_metrics_are_global_not_rank_zeros' below.
def test_two_ranks_match_one_on_full_batch_sgd(env, tmp_path):
    """(b) The same global batch (every example, one step an epoch): np=2 == np=1."""
    args = ("--epochs", 3, "--batch-size", 0, "--optimizer", "sgd", "--lr", 0.5, "--no-scale-lr")
    for np_ in (1, 2):
        fit(env, np_, str(tmp_path / f"np{np_}"), *args)
    _, one = weights(str(tmp_path / "np1"))
    _, two = weights(str(tmp_path / "np2"))
    assert max(float(np.abs(a - b).max()) for a, b in zip(one, two)) < 1e-5
    assert float(np.abs(one[0]).max()) > 1e-2  # it trained
    m1, m2 = metrics(str(tmp_path / "np1")), metrics(str(tmp_path / "np2"))
    for a, b in zip(m1, m2):  # global metrics: the same numbers on 1 and 2 ranks
        for k in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert a[k] == pytest.approx(b[k], abs=1e-5), k


# Keras 3 only: a signal is hvdtrain's handler and checkpoint, the same under either Keras.
# Under Keras 2 the fit path's exact resume is test_resume_edges' (both kinds of checkpoint),
# test_models' (steps_per_execution 3) and test_accumulate's (Horovod's aggregation).
def test_sigint_to_one_rank_then_resume_equals_uninterrupted(env, tmp_path):
    """(c) SIGINT (Ctrl-C) to rank 1, a preemption as SIGTERM is (the same handler; SIGTERM
    on the fit path: test_examples, test_pipeline): exit 75 at a shared step, rank 0's
    checkpoint; the rerun ends with the uninterrupted run's weights and metrics."""
    args = (
        "--epochs",
        6,
        "--batch-size",
        16,
        "--optimizer",
        "sgd",
        "--lr",
        0.05,
        "--checkpoint-every",
        20,
    )
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    fit(env, 2, whole, *args, timeout=240)
    proc = start(launch_example(2, EXAMPLE, *DENSE, "--run-dir", cut, *args), env)
    try:
        pids = wait_for(lambda: (lambda d: d if len(d) == 2 else None)(rank_pids(cut)), 120)
        assert pids and wait_for(lambda: C.list_checkpoints(cut + "/checkpoints"), 120)
        os.kill(pids[1], signal.SIGINT)
    finally:
        rc, out, err = finish(proc, 120)
    # horovodrun exits 1 whatever its ranks' status; it names the first rank's: 75.
    assert rc == 1 and "Exit code: 75" in err, f"rc {rc}\n{out[-2000:]}\n{err[-3000:]}"
    stopped = [l for l in err.splitlines() if "stopped by SIGINT at step" in l]
    assert len(stopped) == 1, err[-3000:]  # rank 0 says it once, naming rank 1's signal
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    newest = C.list_checkpoints(cut + "/checkpoints")[0]
    assert newest[0] == step and step < 6 * 125  # saved at the shared step, before the end
    assert not os.path.exists(os.path.join(cut, "result.json"))
    proc = fit(env, 2, cut, *args, timeout=240)
    assert f"step {step}" in proc.stderr  # the rerun said where it resumed
    _, a = weights(whole)
    _, b = weights(cut)
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) < 1e-6
    assert result(cut)["global_step"] == result(whole)["global_step"] == 6 * 125
    for r, s in zip(metrics(whole), metrics(cut)):  # exact metrics across the resume too
        for k in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert s[k] == pytest.approx(r[k], abs=1e-5), (r["epoch"], k)
    assert len(metrics(cut)) == 6


@pytest.mark.keras2
def test_epoch_metrics_are_global_not_rank_zeros(env, tmp_path):
    """(d) With a learning rate of 0 the weights never move, so the epoch's training and
    validation metrics can be recomputed exactly: over both ranks' examples, not rank 0's."""
    from hvdtrain.distributed import World
    from hvdtrain.inputs.arrays import epoch_plan, test_shard
    from hvdtrain.inputs.loaders import load_mnist_format

    run_dir = str(tmp_path / "run")
    fit(env, 2, run_dir, "--epochs", 1, "--batch-size", 100, "--optimizer", "sgd", "--lr", 0)
    record = metrics(run_dir)[0]
    data = load_mnist_format("mnist", None, False, World(), lambda m: None)
    model, _ = weights(run_dir)

    def scores(x, y):
        p = np.asarray(
            model.predict((x[..., None] / 255.0).astype("float32"), verbose=0), dtype=np.float64
        )
        return np.mean(p.argmax(-1) == y), np.mean(-np.log(p[np.arange(len(y)), y]))

    plans = [epoch_plan(len(data.x_train), 100, r, 2, 0, 0).ravel() for r in (0, 1)]
    everyone = np.concatenate(plans)
    acc, loss = scores(data.x_train[everyone], data.y_train[everyone])
    acc0, _ = scores(data.x_train[plans[0]], data.y_train[plans[0]])
    assert record["accuracy"] == pytest.approx(acc, abs=1e-6)
    assert record["loss"] == pytest.approx(loss, abs=1e-4)
    assert abs(acc0 - acc) > 1e-3  # rank 0's own value would have failed the check above
    val_acc, val_loss = scores(data.x_test, data.y_test)
    shard0 = test_shard(len(data.x_test), 0, 2)
    val_acc0, _ = scores(data.x_test[shard0], data.y_test[shard0])
    assert record["val_accuracy"] == pytest.approx(val_acc, abs=1e-6)
    assert record["val_loss"] == pytest.approx(val_loss, abs=1e-4)
    assert abs(val_acc0 - val_acc) > 1e-3


def code_lines(path):
    """An example's code: no module docstring, comments or blank lines."""
    import ast

    src = open(path).read()
    body = src.split('"""', 2)[2] if ast.get_docstring(ast.parse(src)) else src
    return [l for l in body.splitlines() if l.strip() and not l.strip().startswith("#")]


def test_the_port_changes_few_lines_of_the_plain_script(env, tmp_path):
    """The plain single-process Keras script runs, and the fit guide's diff size is true."""
    import difflib

    from conftest import ROOT

    p = run(
        launch_example(
            1, "keras_mnist_plain.py", *DENSE, "--epochs", 1, "--run-dir", str(tmp_path)
        ),
        env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "model.keras").exists()
    plain, ported = (
        code_lines(os.path.join(ROOT, "examples", n)) for n in ("keras_mnist_plain.py", EXAMPLE)
    )
    diff = [
        l
        for l in difflib.unified_diff(plain, ported, lineterm="", n=0)
        if l[:1] in "+-" and l[:3] not in ("+++", "---")
    ]
    removed, added = sum(l[0] == "-" for l in diff), sum(l[0] == "+" for l in diff)
    readme = docs_text("guides/keras-fit.md")
    claim = f"{removed} of its {len(plain)} code lines replaced by {added}"
    assert claim in readme, claim
