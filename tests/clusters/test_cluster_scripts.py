"""scripts/slurm_job.sh's commands (DRY_RUN) and scripts/gpu_check.sh, run for real where this
machine allows, as the SLURM and GPUs guides print them. slurm_job.sh itself runs under a real
SLURM in test_slurm.py.

(Their syntax and lint are checked with every script in test_scripts.py.)
"""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from test_multihost import horovodrun_args

from conftest import ROOT, clean_env, result, run
from docs_pages import block

SLURM_JOB = os.path.join(ROOT, "scripts", "slurm_job.sh")
GPU_CHECK = os.path.join(ROOT, "scripts", "gpu_check.sh")
# The SLURM guide's submissions: [(sbatch's flags, slurm_job.sh's arguments)].
SBATCH = block("guides/clusters/slurm.md", "sbatch scripts/slurm_job.sh ")
# The GPUs guide's check as printed (run from the checkout's root), and its comment's variant.
GPU_GUIDE = block("guides/gpus.md", "scripts/gpu_check.sh ")
(GPU_CHECK_LINE,) = GPU_GUIDE.commands()
GPU_CHECK_GLOO = re.search(r"#\s*or (.+)$", GPU_GUIDE.text.splitlines()[0]).group(1).strip()


def submissions():
    out = []
    for line in SBATCH.commands():
        words = shlex.split(line)
        i = words.index("scripts/slurm_job.sh")
        assert words[0] == "sbatch" and i >= 1, words
        out.append((words[1:i], words[i + 1 :]))
    return out


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
    allocation = dict(
        SLURM_JOB_NODELIST="localhost",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2(x1)",
        SLURM_SUBMIT_DIR=ROOT,
        PYTHON=sys.executable,
    )
    return clean_env(tmp_path / "home", **dict(allocation, **extra))


def job_variables(flags):
    """What sbatch's flags put in the job's environment: --export's NAME=value, the job name."""
    out = {}
    for flag in flags:
        name, _, value = flag.partition("=")
        if name == "--export":
            out.update(v.split("=", 1) for v in value.split(",")[1:])
            assert value.split(",")[0] == "ALL", flag  # the submitting shell's too
        elif name == "--job-name":
            out["SLURM_JOB_NAME"] = value
    return out


@pytest.mark.quick
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch not installed")
def test_the_slurm_guides_sbatch_flags_are_sbatchs(tmp_path):
    """Every flag of the guide's submissions is one `sbatch --help` lists (the GPU line's
    too, which no test submits: these nodes have no GPU), and the first line's comment is the
    script's own #SBATCH resources."""
    conf = tmp_path / "slurm.conf"  # sbatch reads a configuration even for --help
    conf.write_text("ClusterName=docs\nSlurmctldHost=localhost\n")
    p = subprocess.run(
        ["sbatch", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, SLURM_CONF=str(conf)),
    )
    assert p.returncode == 0, p.stderr
    known = set(re.findall(r"^\s+(?:-\w, )?(--[\w-]+)", p.stdout, re.M))
    flags = [f.partition("=")[0] for f, _ in [(f, a) for fl, a in submissions() for f in fl]]
    assert "--gpus-per-node" in flags and set(flags) <= known, set(flags) - known
    sbatch_lines = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", open(SLURM_JOB).read(), re.M))
    nodes, tasks = re.search(r"(\d+) nodes x (\d+) task", SBATCH.text.splitlines()[0]).groups()
    assert (sbatch_lines["nodes"], sbatch_lines["ntasks-per-node"]) == (nodes, tasks)


@pytest.mark.quick
def test_slurm_srun_command(tmp_path):
    """Each of the guide's srun submissions, as the job runs it (DRY_RUN): the task (MNIST
    when none is named) and its flags, after the run directory named after the job name."""
    ran = 0
    for flags, args in submissions():
        variables = job_variables(flags)
        if variables.get("LAUNCHER", "srun") != "srun":
            continue
        env = slurm_env(
            tmp_path, DRY_RUN="1", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(tmp_path), **variables
        )
        p = run(["bash", SLURM_JOB, *args], env, timeout=30)
        assert p.returncode == 0, p.stderr
        task, *rest = args or ["mnist"]
        name = variables.get("SLURM_JOB_NAME", "hvdtrain")
        run_dir = (
            []
            if "--run-dir" in rest
            else [
                "--run-dir",
                str(tmp_path / "runs" / f"{name}-{re.sub(r'[^A-Za-z0-9._-]', '_', task)}"),
            ]
        )
        # No --kill-on-bad-exit: srun would kill the ranks still saving after a SIGTERM; --wait:
        # the others ended 60 s after the first task (one dead before hvd.init: test_slurm). The
        # run directory is named after the job name, not its id, so a resubmission finds it.
        assert p.stdout.split() == [
            "srun",
            "--mpi=pmix",
            "--cpu-bind=none",
            "--kill-on-bad-exit=0",
            "--wait=60",
            sys.executable,
            "-m",
            "hvdtrain",
            task,
            *run_dir,
            *rest,
        ], (args, p.stdout)
        ran += 1
    assert ran == len(submissions()) - 1  # all but the mpirun one
    env = slurm_env(tmp_path, DRY_RUN="1", SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(tmp_path))
    p = run(["bash", SLURM_JOB, "mnist"], dict(env, SLURM_WAIT="300"), timeout=30)
    assert p.returncode == 0 and " --wait=300 " in p.stdout, p.stderr  # Slurm's own variable


@pytest.mark.quick
def test_slurm_run_dir_from_the_flags(tmp_path):
    """A --run-dir among the flags is the one used (and the only one passed)."""
    for flags in (["--run-dir", "/data/r1"], ["--run-dir=/data/r1"]):
        env = slurm_env(tmp_path, DRY_RUN="1", SLURM_JOB_ID="5")
        p = run(["bash", SLURM_JOB, "pkg.mod:MyTask", *flags, "--epochs", "1"], env, timeout=30)
        assert p.returncode == 0, p.stderr
        assert p.stdout.split()[-len(flags) - 2 :] == [*flags, "--epochs", "1"]
        assert p.stdout.count("--run-dir") == 1


@pytest.mark.quick
def test_slurm_default_run_dir_of_a_task_spec(tmp_path):
    env = slurm_env(tmp_path, DRY_RUN="1", SLURM_JOB_ID="5", SLURM_SUBMIT_DIR=str(tmp_path))
    p = run(["bash", SLURM_JOB, "pkg.mod:MyTask"], env, timeout=30)
    assert p.returncode == 0, p.stderr
    assert f"--run-dir {tmp_path}/runs/hvdtrain-pkg.mod_MyTask" in p.stdout


@pytest.mark.quick
def test_slurm_mpirun_command_and_hostfile(tmp_path):
    """The guide's mpirun submission (its --export's variables, its task) in a 2-node
    allocation of 4 tasks each."""
    ((flags, args),) = [
        (f, a) for f, a in submissions() if job_variables(f).get("LAUNCHER") == "mpirun"
    ]
    path = fake(
        tmp_path, "scontrol", 'test "$1 $2" = "show hostnames" && printf "gpu01\\ngpu02\\n"\n'
    )
    env = slurm_env(
        tmp_path,
        DRY_RUN="1",
        SLURM_NTASKS="8",
        SLURM_NTASKS_PER_NODE="4(x2)",
        SLURM_JOB_NODELIST="gpu[01-02]",
        SLURM_JOB_ID="7",
        TMPDIR=str(tmp_path),
        **job_variables(flags),
    )
    env["PATH"] = path + os.pathsep + env["PATH"]
    assert args == ["linear"], args
    p = run(["bash", SLURM_JOB, *args], env, timeout=30)
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


def gpu_check(line, env, timeout):
    """A gpu_check.sh command line of the GPUs guide, run as printed from the checkout's root."""
    return run(["bash", "-c", line], env, timeout=timeout, cwd=ROOT)


@pytest.mark.quick
def test_the_gpu_guides_commands_are_what_ci_and_these_tests_run():
    """The GPUs guide's first block: the GPU build, which scripts/test_gpu_build.sh runs in
    every CI run (scripts/test.sh) with no CUDA toolkit visible, is that script's setup.sh
    command, less its own venv, apt and --wheels settings; the check is the one the tests
    below run. Its comment's CONTROLLER is a horovodrun flag, which gpu_check.sh passes on."""
    build, check = block("guides/gpus.md", "HVDTRAIN_GPU=1 scripts/setup.sh ").commands()
    assert check == GPU_CHECK_LINE
    words = shlex.split(build)
    ci = open(os.path.join(ROOT, "scripts", "test_gpu_build.sh")).read()
    (line,) = [
        l for l in ci.splitlines() if re.match(r"HVDTRAIN_GPU=1 .*scripts/setup\.sh\" --wheels", l)
    ]
    ci_words = shlex.split(line)
    assert [w for w in ci_words if "=" not in w][0] == "$root/" + words[-1], line
    assert set(words[:-1]) <= set(ci_words), line  # HVDTRAIN_GPU=1
    assert [w.split("=")[0] for w in ci_words if "=" in w and w not in words] == [
        "HVDTRAIN_VENV",
        "HVDTRAIN_SKIP_APT",
    ] and ci_words[-2] == "--wheels", line
    test_sh = open(os.path.join(ROOT, "scripts", "test.sh")).read()
    assert '"$root/scripts/test_gpu_build.sh"' in test_sh
    controller = shlex.split(GPU_CHECK_GLOO)
    assert controller[1:] == shlex.split(GPU_CHECK_LINE), GPU_CHECK_GLOO
    name, value = controller[0].split("=")
    assert name == "CONTROLLER" and horovodrun_args([value, "-np", "2", "true"]).use_gloo is True
    assert '"$horovodrun" -np "$gpus" ${CONTROLLER:-} "$@"' in open(GPU_CHECK).read()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_gpu_check_without_a_driver(env):
    p = gpu_check(GPU_CHECK_LINE, dict(env, PYTHON=sys.executable), timeout=60)
    assert p.returncode == 1
    assert p.stderr.strip() == (
        "gpu_check.sh: error: no GPU: nvidia-smi not found (no NVIDIA driver on this machine)"
    )


def test_gpu_check_when_nvidia_smi_lists_none(env, tmp_path):
    """The guide's Gloo variant (the check stops before it launches anything)."""
    path = fake(tmp_path, "nvidia-smi", 'echo "No devices were found"; exit 6\n')
    env = dict(env, PYTHON=sys.executable, PATH=path + os.pathsep + env["PATH"])
    p = gpu_check(GPU_CHECK_GLOO, env, timeout=60)
    assert p.returncode == 1 and "gpu_check.sh: error: no GPU: nvidia-smi -L failed" in p.stderr


def test_gpu_check_with_cpu_tensorflow(env, tmp_path):
    """nvidia-smi sees two GPUs but TensorFlow none: say so, and train nothing."""
    path = fake(
        tmp_path, "nvidia-smi", 'echo "GPU 0: A (UUID: GPU-a)"; echo "GPU 1: B (UUID: GPU-b)"\n'
    )
    env = dict(
        env, PYTHON=sys.executable, PATH=path + os.pathsep + env["PATH"], OUT=str(tmp_path / "out")
    )
    p = gpu_check(GPU_CHECK_LINE, env, timeout=120)
    if "gpus        none visible" not in p.stdout:  # the doctor's report
        pytest.skip("TensorFlow sees GPUs here")
    assert p.returncode == 1
    assert "nvidia-smi lists 2 GPU(s) but TensorFlow sees 0" in p.stderr
    assert "fix: HVDTRAIN_GPU=1 scripts/setup.sh" in p.stdout  # the doctor's report
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no GPU: nvidia-smi not found")
def test_gpu_check_on_this_machines_gpus(env, tmp_path):
    p = gpu_check(GPU_CHECK_LINE, dict(env, PYTHON=sys.executable, OUT=str(tmp_path)), timeout=880)
    assert p.returncode == 0, p.stdout + p.stderr
    gpus = sum(l.startswith("GPU ") for l in p.stdout.splitlines())
    assert result(tmp_path / "linear")["world_size"] == gpus >= 1
    assert result(tmp_path / "mnist")["test_accuracy"] > 0.5
    assert f"OK: {gpus} GPU(s)" in p.stdout
