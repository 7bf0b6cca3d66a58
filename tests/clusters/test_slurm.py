"""scripts/slurm_job.sh under a real SLURM: two nodes, sbatch, srun with PMIx, mpirun, scancel.

The cluster (tests/slurm_cluster.py) is SLURM 22.05 with munge, slurmctld and a slurmd on each
of two nodes, nodeA and nodeB: network namespaces joined by a veth, each with 2 CPUs. Every
job is submitted as the SLURM guide (docs/guides/clusters/slurm.md) says, `sbatch [flags]
scripts/slurm_job.sh TASK [flags]` (its own lines' sbatch flags and tasks, with this test's
task flags), from a test directory (HVDTRAIN_ROOT names the checkout), and must reproduce a
horovodrun or mpirun run of the same settings on this machine: world size 2, ranks identical,
the same weights. Preemption: `scancel --signal=TERM` ends the job with status 75 and a checkpoint, each
time; submitting the same command again resumes, as does `scontrol requeue`, to the
uninterrupted run's weights.
"""

import os
import re
import shlex
import sys
import time

import numpy as np
import pytest
from test_cluster_scripts import job_variables, submissions

import rank_env
from conftest import HOROVODRUN, ROOT, clean_env, launch, result, run
from docs_pages import block
from hvdtrain.engine import checkpoint_file as C
from slurm_cluster import IFACE, SlurmCluster

# The first test's bound also covers the module's fixtures: daemons started (the hosts, their
# sshd or SLURM's), and the reference runs. Twice pyproject.toml's (pytest's timeout).
pytestmark = pytest.mark.timeout(600)

SLURM_JOB = os.path.join(ROOT, "scripts", "slurm_job.sh")
EXAMPLES = os.path.join(ROOT, "examples")
# Two epochs of one full-batch step: not converged, so equal weights mean equal trajectories.
LINEAR = ["--epochs", "2", "--learning-rate", "0.1"]
# 1,000 small steps (about 10 s under SLURM here), a checkpoint every 50: room to stop it often.
LONG = [
    "--batch-size",
    "5",
    "--epochs",
    "10",
    "--learning-rate",
    "0.0005",
    "--checkpoint-every",
    "50",
    "--verbose",
    "0",
]
MNIST = [
    "--batch-size",
    "50",
    "--epochs",
    "1",
    "--learning-rate",
    "0.5",
    "--no-download",
    "--verbose",
    "0",
]
CONV = [
    "--train-examples",
    "256",
    "--filters",
    "4",
    "--epochs",
    "1",
    "--batch-size",
    "32",
    "--verbose",
    "0",
]


# The guide's submissions, [(sbatch's flags, slurm_job.sh's arguments)], in its order: MNIST;
# linear and its flags; one node; mpirun over ib0; a named job with a Task and a run directory;
# GPUs.
GUIDE = submissions()
# The first line of a job's output, as the guide shows it for a job submitted from
# /home/me/hvdtrain.
BANNER = block("guides/clusters/slurm.md", "slurm_job.sh: linear on 2 processes").text.strip()


def guide_submission(i, **values):
    """The guide's i-th submission: its sbatch flags, its --export's values replaced by
    VALUES; its task and arguments."""
    flags, args = GUIDE[i]
    out = []
    for flag in flags:
        if flag.startswith("--export="):
            variables = dict(job_variables([flag]), **values)
            flag = "--export=ALL," + ",".join(f"{k}={v}" for k, v in variables.items())
        out.append(flag)
    return out, args


def guide_test_only_sample():
    """[(sbatch's words, what it prints, its exit status)] of the guide's --test-only block."""
    lines = block("guides/clusters/slurm.md", "$ sbatch --test-only ").text.splitlines()
    out = []
    for command, printed in zip(lines[::2], lines[1::2]):
        assert command.startswith("$ sbatch "), command
        status = re.fullmatch(r"(.*?)\s+\(exit (\d+)\)", printed)
        out.append(
            (
                shlex.split(command[2:]),
                status.group(1) if status else printed,
                int(status.group(2)) if status else 0,
            )
        )
    return out


def as_submitted(words):
    """A guide's sbatch line as this test runs it: the script by its path in the checkout."""
    return [SLURM_JOB if w == "scripts/slurm_job.sh" else w for w in words]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.create()
    finally:
        cluster.destroy()  # and checks that no process, namespace or mount is left


@pytest.fixture(scope="module")
def reference(tmp_path_factory, references):
    """The same settings on this machine, without SLURM: horovodrun --gloo or mpirun, 2 ranks.
    The linear runs are the session's shared references (the multi-host tests and the fault
    tests compare against the same two; "long"'s checkpoints are the fault tests' every 100
    steps: where a run saves does not change its weights)."""
    from conftest import LINEAR as FAULTS_LINEAR

    base = tmp_path_factory.mktemp("reference")
    env = clean_env(base / "home", PYTHONPATH=os.pathsep.join([ROOT, EXAMPLES]))
    out = {}
    for name, args in (("linear", LINEAR), ("long", FAULTS_LINEAR)):
        out[name] = references.run("gloo", 2, "linear", *args)
        out[name]["dir"] = references.run_dir("gloo", 2, "linear", *args)
    for name, cmd in (
        ("mnist", launch("mpirun", 2, "mnist", *MNIST)),
        (
            "conv",
            [
                HOROVODRUN,
                "-np",
                "2",
                "--gloo",
                sys.executable,
                "-m",
                "hvdtrain",
                "conv_task:ConvTask",
                *CONV,
            ],
        ),
    ):
        p = run([*cmd, "--run-dir", str(base / name)], env)
        assert p.returncode == 0, p.stderr
        out[name] = result(base / name)
        out[name]["dir"] = base / name
    return out


def job_env(tmp_path, **extra):
    # sbatch passes the submitting environment to the job (--export=ALL, its default).
    return clean_env(
        tmp_path / "home",
        HVDTRAIN_ROOT=ROOT,
        PYTHON=sys.executable,
        PYTHONPATH=os.pathsep.join([ROOT, EXAMPLES]),
        OMPI_ALLOW_RUN_AS_ROOT=1,
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,
        **extra,
    )


def submit(slurm, tmp_path, env, *args, sbatch=()):
    """``sbatch [sbatch] scripts/slurm_job.sh args`` from ``tmp_path``; the job id."""
    p = slurm.client("sbatch", "--parsable", *sbatch, SLURM_JOB, *args, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().split(";")[0]


def finished(slurm, job_id, tmp_path, timeout=120):
    """Wait until the job has left the queue; its ``scontrol show job`` fields and output."""
    deadline = time.monotonic() + timeout
    while slurm.client("squeue", "-h", "-j", job_id).stdout.strip():
        if time.monotonic() > deadline:
            slurm.client("scancel", "--signal=KILL", job_id)
            pytest.fail(f"job {job_id} still queued after {timeout}s:\n{output(tmp_path, job_id)}")
        time.sleep(0.2)
    return slurm.job(job_id), output(tmp_path, job_id)


def output(tmp_path, job_id):
    path = tmp_path / f"hvdtrain-{job_id}.out"  # the script's #SBATCH --output
    return path.read_text() if path.exists() else "(no output file)"


def checkpoints(run_dir):
    return C.list_checkpoints(os.path.join(run_dir, "checkpoints"))


def wait_checkpoint_after(slurm, job_id, run_dir, step, timeout=90):
    deadline = time.monotonic() + timeout
    while not any(s > step for s, _ in checkpoints(run_dir)):
        assert time.monotonic() < deadline, f"no checkpoint after step {step} in {timeout}s"
        time.sleep(0.1)


def assert_same_run(r, ref):
    assert (r["world_size"], r["backend"], r["ranks_identical"]) == (2, "horovod", True)
    assert r["global_step"] == ref["global_step"]
    if "weights" in r:  # linear
        np.testing.assert_allclose(r["weights"], ref["weights"], atol=1e-6)
        assert abs(r["bias"] - ref["bias"]) < 1e-6
    else:
        assert abs(r["final_loss"] - ref["final_loss"]) < 1e-6
        assert r["test_accuracy"] == ref["test_accuracy"]


def test_the_cluster(slurm):
    nodes = slurm.client("sinfo", "-h", "-N", "-o", "%N %t %c").stdout.split("\n")
    assert [l.split() for l in nodes if l] == [["nodeA", "idle", "2"], ["nodeB", "idle", "2"]]
    p = slurm.client("srun", "-N", "2", "-n", "2", "hostname")
    assert sorted(p.stdout.split()) == ["nodeA", "nodeB"], p.stderr
    assert "pmix" in slurm.client("srun", "--mpi=list").stdout


# The documented default first: `sbatch scripts/slurm_job.sh TASK` asks for no GPU (item 1 of
# issue 20) and 2 nodes x 1 task of 2 CPUs, which these nodes have.
# (One node, both ranks on nodeA: the requeue and the mpirun preemption tests below.)
@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_linear_on_two_nodes(slurm, reference, tmp_path, launcher):
    """The guide's `sbatch scripts/slurm_job.sh linear --epochs 5` (srun), and its
    `sbatch --export=ALL,LAUNCHER=mpirun,IFACE=ib0 scripts/slurm_job.sh linear` with this
    cluster's interface (mpirun); this test's flags for linear's. The first line of the output
    is the guide's, but for the run directory and launcher. Both ranks start with glibc's
    huge-page tunable from the job script (srun's environment; mpirun's -x)."""
    env = rank_env.logging(job_env(tmp_path), tmp_path)
    flags, args = guide_submission(1) if launcher == "srun" else guide_submission(3, IFACE=IFACE)
    assert args[0] == "linear" and job_variables(flags).get("LAUNCHER", "srun") == launcher
    rx = slurm.rx_bytes("nodeB")
    job = submit(slurm, tmp_path, env, "linear", *LINEAR, sbatch=flags)  # #SBATCH's resources
    info, out = finished(slurm, job, tmp_path)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    run_dir = tmp_path / "runs" / "hvdtrain-linear"  # the job name's, not the job id's
    assert_same_run(result(run_dir), reference["linear"])
    assert info["NodeList"] == "nodeA,nodeB"
    assert slurm.rx_bytes("nodeB") - rx > 10_000  # the ranks talked over the veth
    banner = [l for l in out.splitlines() if l.startswith("slurm_job.sh:")]
    assert banner == [
        BANNER.replace("/home/me/hvdtrain", str(tmp_path)).replace("), srun; ", f"), {launcher}; ")
    ], out
    assert "could not find environment variable" not in out, out  # no -x for unset names
    rank_env.assert_launcher_set_it(tmp_path, 2)


def test_mnist_with_srun(slurm, reference, tmp_path):
    job = submit(slurm, tmp_path, job_env(tmp_path), "mnist", *MNIST)
    info, out = finished(slurm, job, tmp_path)
    assert info["ExitCode"] == "0:0", out
    r = result(tmp_path / "runs" / "hvdtrain-mnist")
    assert_same_run(r, reference["mnist"])
    assert r["dataset"] == "mnist_sample" and r["test_accuracy"] > 0.7


def test_user_task_with_mpirun_and_its_own_run_dir(slurm, reference, tmp_path):
    """The guide's `sbatch --job-name=conv scripts/slurm_job.sh mypackage.tasks:MyTask
    --run-dir /shared/r1`, with examples/conv_task.py's Task and a run directory here:
    the banner shows that one."""
    env = job_env(tmp_path, LAUNCHER="mpirun", IFACE=IFACE)
    flags, (spec, *args) = guide_submission(4)
    assert ":" in spec and args[0] == "--run-dir" and len(args) == 2, (spec, args)
    job = submit(
        slurm,
        tmp_path,
        env,
        "conv_task:ConvTask",
        "--run-dir",
        str(tmp_path / "mine"),
        *CONV,
        sbatch=flags,
    )
    info, out = finished(slurm, job, tmp_path)
    assert info["ExitCode"] == "0:0", out
    r = result(tmp_path / "mine")
    assert r["task"] == "conv"
    assert_same_run(r, reference["conv"])
    assert f"; run dir {tmp_path / 'mine'}\n" in out and not (tmp_path / "runs").exists()


def stop(slurm, job_id, tmp_path, run_dir, after, how, statuses=("75:0",)):
    """Wait for a checkpoint after step ``after``, send SIGTERM ``how``; the step it stopped at."""
    wait_checkpoint_after(slurm, job_id, run_dir, after)
    p = slurm.client("scancel", *how, "--signal=TERM", job_id)
    assert p.returncode == 0, p.stderr
    info, out = finished(slurm, job_id, tmp_path)
    assert info["JobState"] == "FAILED" and info["ExitCode"] in statuses, out
    stopped = re.findall(r"stopped by SIGTERM at step (\d+); checkpoint saved", out)
    assert len(stopped) == 1, out
    assert checkpoints(run_dir)[0][0] == int(stopped[0])  # saved at the step it stopped at
    assert not (run_dir / "result.json").exists()
    return int(stopped[0])


def test_scancel_term_gives_75_each_time_and_resubmitting_resumes(slurm, reference, tmp_path):
    """srun, two nodes: SIGTERM three times, each time a checkpoint at the step it stopped at,
    then the same sbatch runs to the end with the uninterrupted run's weights.

    `scancel --batch --signal=TERM` (the script, which signals its node's ranks) gives 75 every
    time. A plain `scancel --signal=TERM` (SLURM signals every task) always stops the ranks
    with a checkpoint too, but SLURM then counts the step as cancelled: when one node's rank
    exits before the other's, srun prints "Force Terminated" and SIGTERMs the other, which
    by then has left hvdtrain's handler, and the job ends 143 (1 of 6 plain stops here)."""
    env, run_dir = job_env(tmp_path), tmp_path / "runs" / "hvdtrain-linear"
    step = 0
    for how, statuses in (
        ((), ("75:0", "143:0")),
        (("--batch",), ("75:0",)),
        (("--batch",), ("75:0",)),
    ):
        job = submit(slurm, tmp_path, env, "linear", *LONG)
        step = stop(slurm, job, tmp_path, run_dir, step, how, statuses)
        if how:
            assert f"resumed from {run_dir}/checkpoints/" in output(tmp_path, job)
    job = submit(slurm, tmp_path, env, "linear", *LONG)
    info, out = finished(slurm, job, tmp_path)
    assert info["ExitCode"] == "0:0" and f"ckpt-{step:09d}.hvdt at epoch" in out, out
    assert_same_run(result(run_dir), reference["long"])


ONE_NODE = tuple(guide_submission(2)[0])  # the guide's one-node line's flags
assert ONE_NODE == ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"), ONE_NODE


def test_mpirun_on_one_node_scancel_batch_term_gives_75_then_resumes(slurm, reference, tmp_path):
    """mpirun: `scancel --batch --signal=TERM` reaches the script, which passes it to its
    node's ranks (a SIGTERM to mpirun itself would end the job 1, not 75)."""
    env = job_env(tmp_path, LAUNCHER="mpirun", IFACE=IFACE)
    run_dir = tmp_path / "runs" / "hvdtrain-linear"
    job = submit(slurm, tmp_path, env, "linear", *LONG, sbatch=ONE_NODE)
    step = stop(slurm, job, tmp_path, run_dir, 0, ("--batch",))
    assert slurm.job(job)["NodeList"] == "nodeA"
    job = submit(slurm, tmp_path, env, "linear", *LONG, sbatch=ONE_NODE)
    info, out = finished(slurm, job, tmp_path)
    assert info["ExitCode"] == "0:0" and f"ckpt-{step:09d}.hvdt at epoch" in out, out
    assert_same_run(result(run_dir), reference["long"])


def test_srun_on_one_node_scontrol_requeue_resumes(slurm, reference, tmp_path):
    env, run_dir = job_env(tmp_path), tmp_path / "runs" / "hvdtrain-linear"
    job = submit(slurm, tmp_path, env, "linear", *LONG, sbatch=ONE_NODE)
    wait_checkpoint_after(slurm, job, run_dir, 0)
    p = slurm.client("scontrol", "requeue", job)
    assert p.returncode == 0, p.stderr
    info, out = finished(slurm, job, tmp_path)  # pending again, then run again to the end
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    assert info["NodeList"] == "nodeA"
    assert f"resumed from {run_dir}/checkpoints/" in out, out
    assert_same_run(result(run_dir), reference["long"])


# A task module whose rank 0 dies by SIGSEGV as it is imported: before hvd.init and the
# watchdog, where no peer can see it go (a crash of TensorFlow's or MPI's start looks the same).
DIES_AT_IMPORT = """
import os, signal
rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("SLURM_PROCID"))
if rank == "0":
    os.kill(os.getpid(), signal.SIGSEGV)
from hvdtrain.linear import LinearTask
"""


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_a_rank_that_dies_before_hvd_init_ends_the_job(slurm, tmp_path, launcher):
    """Two nodes: rank 0 dies (SIGSEGV) importing the task, rank 1 waits in MPI's start for
    it. srun ends rank 1 SLURM_WAIT s (here 5) after rank 0 ended; mpirun ends the job itself.
    The job fails with the crash's status and its line, in bounded time: under srun with
    --kill-on-bad-exit=0 alone it waited until its time limit."""
    (tmp_path / "dies_task.py").write_text(DIES_AT_IMPORT)
    env = job_env(tmp_path, LAUNCHER=launcher, IFACE=IFACE)
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    job = submit(
        slurm, tmp_path, env, "dies_task:LinearTask", *LINEAR, sbatch=("--export=ALL,SLURM_WAIT=5",)
    )
    info, out = finished(slurm, job, tmp_path, timeout=90)  # fails the test on a hang
    assert info["JobState"] == "FAILED", out
    if launcher == "srun":
        assert info["ExitCode"] == "139:0", out  # 128 + SIGSEGV, rank 0's
        assert "srun: error: nodeA: task 0: Segmentation fault" in out, out
        assert "First task exited 5s ago" in out and "task 1: Killed" in out, out
    else:
        assert info["ExitCode"] != "0:0", out
        assert "signal 11 (Segmentation fault)" in out, out
    assert not (tmp_path / "runs" / "hvdtrain-dies_task_LinearTask" / "result.json").exists()


@pytest.mark.parametrize("flag", ["--cpus-per-task=8", "--nodes=3"])
def test_a_request_the_nodes_cannot_hold(slurm, tmp_path, flag):
    """More CPUs per task than a node has, or more nodes than there are: sbatch --test-only
    refuses it in the guide's one line and status (its example, and the same with --nodes=3);
    sbatch alone queues it for ever, so the script never runs. Without the flag, --test-only
    prints the guide's other line (the job number and the time are this cluster's)."""
    env = job_env(tmp_path)
    (refused, says, status), (fits, starts, fits_status) = guide_test_only_sample()
    assert "--cpus-per-task=8" in refused, refused
    words = as_submitted([flag if w == "--cpus-per-task=8" else w for w in refused])
    p = slurm.client(*words, env=env, cwd=tmp_path)
    assert (p.returncode, p.stderr.strip()) == (status, says), p.stdout + p.stderr
    job = submit(slurm, tmp_path, env, "linear", sbatch=(flag,))
    try:
        deadline = time.monotonic() + 10  # the scheduler's first look at it sets the reason
        while slurm.job(job)["Reason"] == "None" and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)  # and it stays so
        info = slurm.job(job)
        # (--nodes=3: PartitionNodeLimit or PartitionConfig, as SLURM first finds it)
        assert info["JobState"] == "PENDING"
        assert info["Reason"] in ("PartitionConfig", "PartitionNodeLimit"), info
    finally:
        slurm.client("scancel", job)
    ok = slurm.client(*as_submitted(fits), env=env, cwd=tmp_path)
    # The job number and its start time are this cluster's.
    shape = lambda line: re.sub(r"(Job )\d+( to start at )\S+", r"\1N\2T", line)  # noqa: E731
    assert shape(starts) != starts, starts
    assert (ok.returncode, shape(ok.stderr.strip())) == (fits_status, shape(starts)), ok.stderr
