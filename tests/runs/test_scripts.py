"""The launch scripts, run for real, and the shell scripts' syntax and lint."""

import glob
import os
import shutil
import subprocess

import pytest

import rank_env
from conftest import ROOT, result, run

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "*.sh"))) + [
    os.path.join(ROOT, ".ci", "run")
]


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
@pytest.mark.quick
def test_bash_syntax_and_shellcheck(script):
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck missing: scripts/setup.sh installs it")
    p = subprocess.run(["shellcheck", script], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


# scripts/launch_local.sh and launch_cluster.sh training (2 workers, the seed's weights) are
# test_quiet's, on a user's raw output.


def test_launch_cluster_rejects_a_missing_hostfile(env, tmp_path):
    p = run(
        [
            "bash",
            os.path.join(ROOT, "scripts", "launch_cluster.sh"),
            str(tmp_path / "nohosts"),
            "linear",
        ],
        env,
        timeout=30,
    )
    assert p.returncode == 2 and "cannot read hostfile" in p.stderr


LOCAL = os.path.join(ROOT, "scripts", "launch_local.sh")


# mpirun passes a SIGINT on about 2 s late (test_faults.py): the Ctrl-C case trains long
# enough (400 epochs, about 10 s here) that the job cannot end before it (40 did, in CI).
@pytest.mark.parametrize("controller,how,epochs", [("--gloo", "SIGTERM", 40), ("", "SIGINT", 400)])
def test_launch_local_sigterm_exits_75_without_traceback_and_resumes(
    controller, how, epochs, env, tmp_path
):
    """SIGTERM to the launch script (or Ctrl-C: SIGINT to its process group) reaches the
    ranks (horovodrun --mpi alone would not pass it on) as SIGTERM; they stop at a shared
    step with a checkpoint; the script exits 75, not 1, and horovodrun's own traceback is
    not shown; the same command then finishes the run (after Ctrl-C, the same command with
    the epochs cut to one past the stop's)."""
    import signal

    from conftest import finish, start, wait_for

    run_dir = tmp_path / "run"
    cmd = [
        "bash",
        LOCAL,
        "linear",
        "--run-dir",
        str(run_dir),
        "--batch-size",
        "5",
        "--epochs",
        str(epochs),
        "--learning-rate",
        "0.0005",
        "--verbose",
        "0",
    ]
    env = dict(env, CONTROLLER=controller)
    proc = start(cmd, env)
    assert wait_for(lambda: (run_dir / "config.json").exists(), 120), "the job did not start"
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)  # to the script only, as a scheduler would
    else:
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: its whole process group
    rc, out, err = finish(proc, 120)
    assert rc == 75, err[-3000:]
    assert "Traceback" not in err and "stopped by SIGTERM at step" in err, err[-3000:]
    assert not (run_dir / "result.json").exists()
    step = int(err.split("stopped by SIGTERM at step ", 1)[1].split(";")[0])
    if how == "SIGINT":  # the run continued one epoch past the stop, not its 400 (35 s here)
        epochs = step // 100 + 1
        cmd[cmd.index("--epochs") + 1] = str(epochs)
    again = run(cmd, env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and f"step {step}" in again.stderr, again.stderr
    assert result(run_dir)["global_step"] == epochs * 100


def test_launch_local_exits_with_the_ranks_status(env, tmp_path):
    """... and its ranks (horovodrun --gloo's here) start with the user's GLIBC_TUNABLES and
    glibc's huge-page tunable after it."""
    (tmp_path / "file").write_text("x")
    user = "glibc.malloc.arena_max=2"
    p = run(
        ["bash", LOCAL, "linear", "--run-dir", str(tmp_path / "file")],
        rank_env.logging(dict(env, CONTROLLER="--gloo", GLIBC_TUNABLES=user), tmp_path),
        timeout=120,
    )
    assert p.returncode == 2, p.stderr  # the ranks' bad-setting status, not horovodrun's 1
    assert "Traceback" not in p.stderr and "is a file, not a directory" in p.stderr
    starts = rank_env.starts(tmp_path)
    assert len(starts) == 2 and all(v == [rank_env.expected(user)] for v in starts.values())
