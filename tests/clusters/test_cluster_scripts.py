"""scripts/slurm_job.sh's commands (DRY_RUN) and scripts/gpu_check.sh, run for real where this
machine allows. slurm_job.sh itself runs under a real SLURM in test_slurm.py.

(Their syntax and lint are checked with every script in test_scripts.py.)
"""
import os
import shutil
import sys

import pytest

from conftest import ROOT, clean_env, result, run

SLURM_JOB = os.path.join(ROOT, "scripts", "slurm_job.sh")
GPU_CHECK = os.path.join(ROOT, "scripts", "gpu_check.sh")


def fake(tmp_path, name, script):
    """A stand-in for a command this machine lacks (scontrol, nvidia-smi), first on PATH."""
    d = tmp_path / "fakebin"
    d.mkdir(exist_ok=True)
    (d / name).write_text("#!/bin/sh\n" + script)
    (d / name).chmod(0o755)
    return str(d)


def slurm_env(tmp_path, **extra):
    # What sbatch sets inside a 1-node, 2-task allocation (SLURM_JOB_ID left out: with it,
    # Open MPI would launch through SLURM's srun, which this machine does not have).
    allocation = dict(SLURM_JOB_NODELIST="localhost", SLURM_NTASKS="2",
                      SLURM_NTASKS_PER_NODE="2(x1)", SLURM_SUBMIT_DIR=ROOT, PYTHON=sys.executable)
    return clean_env(tmp_path / "home", **dict(allocation, **extra))


@pytest.mark.quick
def test_slurm_srun_command(tmp_path):
    env = slurm_env(tmp_path, DRY_RUN="1", IFACE="ib0", SLURM_JOB_ID="4242",
                    SLURM_JOB_NAME="exp1", SLURM_SUBMIT_DIR=str(tmp_path))
    p = run(["bash", SLURM_JOB, "mnist", "--epochs", "5"], env, timeout=30)
    assert p.returncode == 0, p.stderr
    # No --kill-on-bad-exit: srun would kill the ranks still saving after a SIGTERM; --wait:
    # the others ended 60 s after the first task (one dead before hvd.init: test_slurm). The
    # run directory is named after the job name, not its id, so a resubmission finds it.
    assert p.stdout.split() == ["srun", "--mpi=pmix", "--cpu-bind=none", "--kill-on-bad-exit=0",
                                "--wait=60", sys.executable, "-m", "hvdtrain", "mnist",
                                "--run-dir", str(tmp_path / "runs" / "exp1-mnist"), "--epochs",
                                "5"]
    p = run(["bash", SLURM_JOB, "mnist"], dict(env, SLURM_WAIT="300"), timeout=30)
    assert p.returncode == 0 and " --wait=300 " in p.stdout, p.stderr  # Slurm's own variable


@pytest.mark.quick
def test_slurm_run_dir_from_the_flags(tmp_path):
    """A --run-dir among the flags is the one used (and the only one passed)."""
    for flags in (["--run-dir", "/data/r1"], ["--run-dir=/data/r1"]):
        env = slurm_env(tmp_path, DRY_RUN="1", SLURM_JOB_ID="5")
        p = run(["bash", SLURM_JOB, "pkg.mod:MyTask", *flags, "--epochs", "1"], env, timeout=30)
        assert p.returncode == 0, p.stderr
        assert p.stdout.split()[-len(flags) - 2:] == [*flags, "--epochs", "1"]
        assert p.stdout.count("--run-dir") == 1


@pytest.mark.quick
def test_slurm_default_run_dir_of_a_task_spec(tmp_path):
    env = slurm_env(tmp_path, DRY_RUN="1", SLURM_JOB_ID="5", SLURM_SUBMIT_DIR=str(tmp_path))
    p = run(["bash", SLURM_JOB, "pkg.mod:MyTask"], env, timeout=30)
    assert p.returncode == 0, p.stderr
    assert f"--run-dir {tmp_path}/runs/hvdtrain-pkg.mod_MyTask" in p.stdout


@pytest.mark.quick
def test_slurm_mpirun_command_and_hostfile(tmp_path):
    path = fake(tmp_path, "scontrol", 'test "$1 $2" = "show hostnames" && printf "gpu01\\ngpu02\\n"\n')
    env = slurm_env(tmp_path, DRY_RUN="1", LAUNCHER="mpirun", SLURM_NTASKS="8",
                    SLURM_NTASKS_PER_NODE="4(x2)", SLURM_JOB_NODELIST="gpu[01-02]",
                    SLURM_JOB_ID="7", TMPDIR=str(tmp_path))
    env["PATH"] = path + os.pathsep + env["PATH"]
    p = run(["bash", SLURM_JOB, "linear"], env, timeout=30)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split()[:3] == ["env", "NP=8", f"PYTHON={sys.executable}"]
    assert "scripts/launch_cluster.sh" in lines[0] and "linear --run-dir" in lines[0]
    assert lines[1:] == ["hostfile: gpu01 slots=4", "hostfile: gpu02 slots=4"]
    assert not list(tmp_path.glob("hvdtrain-hosts.*"))  # removed on exit


@pytest.mark.quick
def test_slurm_rejects_an_unknown_launcher(tmp_path):
    p = run(["bash", SLURM_JOB], slurm_env(tmp_path, LAUNCHER="pbs"), timeout=30)
    assert p.returncode == 2 and "LAUNCHER=pbs" in p.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_gpu_check_without_a_driver(env):
    p = run(["bash", GPU_CHECK], dict(env, PYTHON=sys.executable), timeout=60)
    assert p.returncode == 1
    assert p.stderr.strip() == ("gpu_check.sh: error: no GPU: nvidia-smi not found "
                                "(no NVIDIA driver on this machine)")


def test_gpu_check_when_nvidia_smi_lists_none(env, tmp_path):
    path = fake(tmp_path, "nvidia-smi", 'echo "No devices were found"; exit 6\n')
    env = dict(env, PYTHON=sys.executable, PATH=path + os.pathsep + env["PATH"])
    p = run(["bash", GPU_CHECK], env, timeout=60)
    assert p.returncode == 1 and "gpu_check.sh: error: no GPU: nvidia-smi -L failed" in p.stderr


def test_gpu_check_with_cpu_tensorflow(env, tmp_path):
    """nvidia-smi sees two GPUs but TensorFlow none: say so, and train nothing."""
    path = fake(tmp_path, "nvidia-smi", 'echo "GPU 0: A (UUID: GPU-a)"; echo "GPU 1: B (UUID: GPU-b)"\n')
    env = dict(env, PYTHON=sys.executable, PATH=path + os.pathsep + env["PATH"],
               OUT=str(tmp_path / "out"))
    p = run(["bash", GPU_CHECK], env, timeout=120)
    if "gpus        none visible" not in p.stdout:  # the doctor's report
        pytest.skip("TensorFlow sees GPUs here")
    assert p.returncode == 1
    assert "nvidia-smi lists 2 GPU(s) but TensorFlow sees 0" in p.stderr
    assert "fix: HVDTRAIN_GPU=1 scripts/setup.sh" in p.stdout  # the doctor's report
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no GPU: nvidia-smi not found")
def test_gpu_check_on_this_machines_gpus(env, tmp_path):
    p = run(["bash", GPU_CHECK], dict(env, PYTHON=sys.executable, OUT=str(tmp_path)),
            timeout=880)
    assert p.returncode == 0, p.stdout + p.stderr
    gpus = sum(l.startswith("GPU ") for l in p.stdout.splitlines())
    assert result(tmp_path / "linear")["world_size"] == gpus >= 1
    assert result(tmp_path / "mnist")["test_accuracy"] > 0.5
    assert f"OK: {gpus} GPU(s)" in p.stdout
