"""Resume from every checkpoint either path writes: SIGKILL a 2-rank run once its first
checkpoint exists, at an epoch's end and in mid-epoch, then rerun the same command; the run
ends with the uninterrupted run's weights (weights_sha256), on the Task path and on hk.fit;
on the Task path each epoch is logged once (test_faults' linear SIGKILL test, merged here)."""

import json
import os

import pytest

from conftest import (
    Lazy,
    checkpoints,
    clean_env,
    keras_flavour,
    kill_after_first_checkpoint,
    launch,
    launch_example,
    result,
    run,
)
from hvdtrain.engine import checkpoint_file as C

# Task path: the linear task, 2 ranks, 100 steps an epoch. Fit path: the Keras example's
# dense model, 2 ranks, 4,000 examples in batches of 16: 125 steps an epoch.
PATHS = {
    "task": lambda run_dir, every: launch(
        "gloo",
        2,
        "linear",
        "--run-dir",
        run_dir,
        "--batch-size",
        "5",
        "--epochs",
        "3",
        "--learning-rate",
        "0.0005",
        "--verbose",
        "0",
        "--checkpoint-every",
        str(every),
    ),
    "fit": lambda run_dir, every: launch_example(
        2,
        "keras_fit_mnist.py",
        "--model",
        "dense",
        "--run-dir",
        run_dir,
        "--epochs",
        "3",
        "--batch-size",
        "16",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--checkpoint-every",
        str(every),
    ),
}
# When the first checkpoint is written: at the end of epoch 1 (checkpoints at epoch ends
# only), or inside epoch 1 (every 30 steps).
WHERE = {"epoch_end": 0, "mid_epoch": 30}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each path's uninterrupted run, made the first time a test of this pass reads it."""
    base = tmp_path_factory.mktemp("whole")
    env = clean_env(base / "home")

    def make(path):
        p = run(PATHS[path](str(base / path), 0), env, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return result(base / path)

    return Lazy(make)


# Under Keras 2 as well: the fit path's epoch-end case (Keras 2's own loop ends the epoch and
# starts the resumed fit at initial_epoch). Its mid-epoch resumes are Keras 2's in
# test_models (steps_per_execution 3, SIGTERM) and test_accumulate (SIGTERM inside an
# accumulation), the Task path's in test_examples (the conv task, SIGTERM); where a Task-path
# checkpoint falls is hvdtrain's, not Keras'.
@pytest.mark.parametrize(
    "path, where",
    [
        pytest.param("fit", "epoch_end", marks=pytest.mark.keras2),
        ("fit", "mid_epoch"),
        ("task", "epoch_end"),
        ("task", "mid_epoch"),
    ],
)
def test_sigkill_then_rerun_ends_with_the_uninterrupted_weights(
    path, where, uninterrupted, env, tmp_path
):
    run_dir = str(tmp_path / "run")
    cmd = PATHS[path](run_dir, WHERE[where])
    killed_at = kill_after_first_checkpoint(cmd, env, run_dir, timeout=180)
    assert 0 < killed_at < uninterrupted[path]["global_step"]
    # The state a kill right after the first save leaves: later checkpoints (if the job got
    # that far before the signal landed) are removed, so each case resumes from its kind.
    first_step, first = checkpoints(run_dir)[-1]
    for _, later in checkpoints(run_dir)[:-1]:
        os.unlink(later)
    meta, _ = C.read(first)
    if where == "epoch_end":
        assert (meta["epoch"], meta["offset"]) == (1, 0), meta
    else:
        assert meta["epoch"] == 0 and 0 < meta["offset"], meta
    p = run(cmd, env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"step {first_step}" in p.stderr, p.stderr[-3000:]  # it said where it resumed
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    r, whole = result(run_dir), uninterrupted[path]
    assert r["global_step"] == whole["global_step"]
    assert r["world_size"] == 2 and r["keras"].split()[0] == keras_flavour()
    assert r["ranks_identical"] is True
    assert r["weights_sha256"] == whole["weights_sha256"]
    assert checkpoints(run_dir)[0][0] == r["global_step"]  # the resumed run's end is saved
    if path == "task":  # (test_faults' linear SIGKILL test, merged here)
        assert r["weights"] == whole["weights"]
        assert r["bias"] == whole["bias"]
        assert abs(r["weights"][0] - 0.1) > 1e-3  # not converged: the trajectories matched
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            epochs = [json.loads(line)["epoch"] for line in f]
        assert epochs == [1, 2, 3]  # each epoch logged once
