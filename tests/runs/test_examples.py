"""The examples a user copies, run exactly as they are: examples/conv_task.py (the Task path)
and the README's own-model example, alone and under horovodrun -np 2."""

import os
import signal

import numpy as np
import pytest

from conftest import (
    ROOT,
    as_printed,
    default_run_dirs,
    finish,
    keras_flavour,
    rank_pids,
    result,
    run,
    script_cmd,
    start,
    wait_for,
)
from docs_pages import block

CONV = os.path.join(ROOT, "examples", "conv_task.py")
SMALL = ["--train-examples", "1024", "--filters", "4", "--verbose", "0"]


def alone(script, *args):
    return script_cmd(1, script, *args)


def two(script, *args):
    return script_cmd(2, script, *args)


def weights(run_dir):
    """The saved model's weights, loaded the way a user would (no hvdtrain)."""
    from hvdtrain.compat import keras

    return [
        np.asarray(w)
        for w in keras().models.load_model(os.path.join(run_dir, "model.keras")).get_weights()
    ]


def assert_same_weights(a, b, atol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=atol)


@pytest.mark.keras2
def test_conv_task_alone_and_on_two_ranks(env, tmp_path):
    args = [*SMALL, "--epochs", "2", "--batch-size", "32", "--learning-rate", "0.01"]
    one = run(alone(CONV, "--run-dir", str(tmp_path / "one"), *args), env)
    assert one.returncode == 0, one.stderr
    two_ = run(two(CONV, "--run-dir", str(tmp_path / "two"), *args), env)
    assert two_.returncode == 0, two_.stderr
    a, b = result(tmp_path / "one"), result(tmp_path / "two")
    assert (a["task"], a["world_size"], b["world_size"]) == ("conv", 1, 2)
    assert b["ranks_identical"] is True and b["keras"].split()[0] == keras_flavour()
    assert a["global_step"] == 2 * 1024 // 32 and b["global_step"] == 2 * 1024 // 64
    assert a["test_accuracy"] > 0.8 and b["test_accuracy"] > 0.7, (a, b)
    assert "--num-workers" not in one.stderr + two_.stderr  # a user task sets no count


# Keras 3 only: under Keras 2 the Task path's 2 ranks = 1 process is test_multiprocess' (SGD,
# unconverged), test_sync_bn's (BN) and test_keras_fit_patterns' (Adam's slots, an
# embedding).
def test_conv_task_two_ranks_equal_one_on_full_batches(env, tmp_path):
    """Adam on the full batch: the mean gradient over two equal shards is the one-process
    gradient, so two ranks take the one-process steps (to float rounding)."""
    args = [*SMALL, "--epochs", "3", "--batch-size", "0", "--train-examples", "512"]
    one = run(alone(CONV, "--run-dir", str(tmp_path / "one"), *args), env)
    two_ = run(two(CONV, "--run-dir", str(tmp_path / "two"), *args), env)
    assert one.returncode == 0 and two_.returncode == 0, one.stderr + two_.stderr
    a, b = result(tmp_path / "one"), result(tmp_path / "two")
    assert a["global_step"] == b["global_step"] == 3
    assert a["global_batch_size"] == b["global_batch_size"] == 512
    assert abs(a["test_loss"] - b["test_loss"]) < 1e-5
    assert_same_weights(weights(tmp_path / "one"), weights(tmp_path / "two"), atol=1e-5)


@pytest.mark.keras2
def test_conv_task_resume_after_sigterm_equals_the_uninterrupted_run(env, tmp_path):
    args = [*SMALL, "--epochs", "2", "--batch-size", "16", "--checkpoint-every", "5"]
    ref = run(two(CONV, "--run-dir", str(tmp_path / "ref"), *args), env)
    assert ref.returncode == 0, ref.stderr
    run_dir = tmp_path / "cut"
    cmd = two(CONV, "--run-dir", str(run_dir), *args)
    proc = start(cmd, env)
    ckpts = run_dir / "checkpoints"
    assert wait_for(lambda: ckpts.exists() and os.listdir(ckpts), 120), "no checkpoint"
    pids = wait_for(
        lambda: rank_pids(str(run_dir)) if len(rank_pids(str(run_dir))) == 2 else None, 30
    )
    os.kill(pids[1], signal.SIGTERM)
    rc, out, err = finish(proc, 120)
    assert not (run_dir / "result.json").exists(), "finished before the SIGTERM"
    assert "stopped by SIGTERM at step" in err, err
    again = run(cmd, env)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr
    r, reference = result(run_dir), result(tmp_path / "ref")
    assert r["global_step"] == reference["global_step"] == 2 * 1024 // 32
    assert r["weights_sha256"] == reference["weights_sha256"]  # bit-identical weights
    assert_same_weights(weights(run_dir), weights(tmp_path / "ref"), atol=0)


def test_readme_user_model_example_runs_as_printed(env, tmp_path):
    """The README's Task example saved as xor.py, and the three commands under it run as
    printed in that directory (the Tasks guide prints the same example and commands:
    tests/unit/test_docs.py)."""
    (tmp_path / "xor.py").write_text(block("README.md", "import keras\n").text)
    alone, two_, by_name = block("README.md", "python xor.py").commands()
    one = run(as_printed(alone), env, cwd=str(tmp_path))
    assert one.returncode == 0, one.stderr
    two_ = run(as_printed(two_), env, cwd=str(tmp_path))
    assert two_.returncode == 0, two_.stderr
    runs = {r["world_size"]: r for r in map(result, default_run_dirs(tmp_path, "xor"))}
    a, b = runs[1], runs[2]
    assert a["task"] == b["task"] == "xor" and len(runs) == 2
    assert (a["epochs"], b["epochs"]) == (40, 60)  # the task's default; the flag's
    assert (a["global_step"], b["global_step"]) == (40 * 256 // 16, 60 * 256 // 32)
    assert a["test_accuracy"] == b["test_accuracy"] == 1.0 and b["ranks_identical"] is True
    # A user task that sets no worker count is not warned about one.
    assert "--num-workers" not in one.stderr + two_.stderr
    helped = run(as_printed(by_name), env, cwd=str(tmp_path))
    assert helped.returncode == 0, helped.stderr
    assert "Train the xor task" in helped.stdout and "(default: 40)" in helped.stdout
    assert len(default_run_dirs(tmp_path, "xor")) == 2  # --help trained nothing


def test_tfrecord_example_alone_as_printed(env, tmp_path):
    """examples/keras_fit_tfrecord.py as its docstring prints it (one process): it writes
    the TFRecord files, trains from them through hk.fit, and a rerun reuses the files."""
    script = os.path.join(ROOT, "examples", "keras_fit_tfrecord.py")
    p = run(alone(script, "--epochs", "1"), env, timeout=240, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    data = tmp_path / "runs" / "mnist_tfrecord"
    assert sorted(os.listdir(data))[:2] == ["test.tfrecord", "train-00-of-07.tfrecord"]
    r = result(tmp_path / "runs" / "keras_fit_tfrecord")
    assert r["train_examples"] == 4000 and r["examples_left_out"] == 0  # one rank: all
    assert r["sharding"] == "none" and r["global_step"] == -(-4000 // 64)
    assert r["final_val_accuracy"] > 0.5, r  # one epoch; chance is 0.1
