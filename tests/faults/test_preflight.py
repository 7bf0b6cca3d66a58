"""Ranks that disagree stop before step 0 with one error naming both values; no hang."""

import sys
import time

import pytest

from conftest import FakeWorld, run
from hvdtrain.engine import preflight


def mpmd(env_args_per_rank, task):
    """One mpirun, a different command line per rank (Open MPI's colon syntax)."""
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    for i, args in enumerate(env_args_per_rank):
        if i:
            cmd.append(":")
        cmd += ["-np", "1", sys.executable, "-m", f"hvdtrain.{task}", *args]
    return cmd


@pytest.mark.parametrize(
    "task, a, b, expect",
    [
        (
            "linear",
            ["--batch-size", "10"],
            ["--batch-size", "20"],
            [
                "setting.batch_size differs (rank 0: 10; rank 1: 20)",
                "steps_per_epoch differs (rank 0: 50; rank 1: 25)",
            ],
        ),
        (
            "mnist",
            ["--model", "mlp", "--hidden-units", "32"],
            ["--model", "mlp", "--hidden-units", "64"],
            [
                "model variable 0 differs (rank 0: sequential/dense/kernel [784, 32] float32; "
                "rank 1: sequential/dense/kernel [784, 64] float32)",
                "setting.hidden_units differs (rank 0: 32; rank 1: 64)",
            ],
        ),
    ],
)
def test_disagreeing_ranks_stop_before_step_0(task, a, b, expect, env, tmp_path):
    common = (
        ["--run-dir", str(tmp_path / "run"), "--no-download"]
        if task == "mnist"
        else ["--run-dir", str(tmp_path / "run")]
    )
    started = time.monotonic()
    p = run(mpmd([a + common, b + common], task), env, timeout=120)
    assert p.returncode != 0
    assert time.monotonic() - started < 60
    errors = [l for l in p.stderr.splitlines() if "error: ranks disagree before step 0" in l]
    assert len(errors) == 1, p.stderr  # rank 0 says it once; every rank exits
    for fragment in expect:
        assert fragment in errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.quick
def test_check_names_every_rank_group():
    mine = {"setting.seed": 1, "version.tensorflow": "2.18.1"}
    preflight.check(FakeWorld([dict(mine), dict(mine)]), mine)  # all agree: no error
    with pytest.raises(preflight.PreflightError) as e:
        preflight.check(
            FakeWorld([dict(mine), dict(mine, **{"version.tensorflow": "2.17.1"})]), mine
        )
    assert str(e.value) == (
        "ranks disagree before step 0: version.tensorflow differs "
        "(ranks 0,1: 2.18.1; rank 2: 2.17.1)"
    )
