"""Horovod on a Ray cluster: Horovod's own ``horovod.ray.RayExecutor`` on Ray 2.60 (the
"ray" extra; scripts/patches/python/horovod-0.28.1-ray2.patch), under Keras 3 and Keras 2.

The module starts one real Ray cluster for its tests: ``ray start --head`` on loopback (a
free port, 2 CPUs, no dashboard, its temporary files under the module's tmp dir), then this
pytest connects to it as the driver. Each test starts two Horovod workers as Ray actors
(``RayExecutor(settings, num_workers=2, cpus_per_worker=1)``), runs a plain Horovod function
from tests/ray_train.py on them (Gloo, which RayExecutor sets up), and asserts that both
ranks end with the same weights, equal to the same steps taken in one process on the whole
batch (a Ray task). The cluster's processes inherit this pytest's environment, so under
scripts/test.sh's Keras 2 pass (TF_USE_LEGACY_KERAS=1) the workers train on tf_keras: that
pass runs the two that train (the tape and hk.fit); the restarts, the driver's SIGTERM and its
bad input are Ray's and the driver's, the same under either Keras (the exact resume after a
signal under Keras 2 is test_resume_edges', test_models' and test_accumulate's).
At the end every process the cluster started is killed (by its session: never `ray stop`,
which would end any Ray on the machine).
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import pytest
import ray  # the test extra has it (the "ray" extra's pin)

from conftest import (
    LINEAR,
    ROOT,
    TESTS,
    TIME_SCALE,
    checkpoints,
    clean_env,
    finish,
    free_port,
    keras_flavour,
    lose_after_first_checkpoint,
    rank_pids,
    result,
    run,
    start,
    wait_for,
)
from docs_pages import block

pytestmark = [pytest.mark.timeout(240)]
EXACT = 1e-6  # float32 arithmetic done in another order than Horovod's


def session_pids(sid):
    """The live processes of session ``sid`` (all that `ray start` started, and theirs)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
                pids.append(int(entry))
    return pids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node Ray cluster on 127.0.0.1 started by ``ray start --head --block`` in its own
    session; this process is its driver. Yields the address."""
    base = tmp_path_factory.mktemp("ray")
    port = free_port()
    env = clean_env(
        base / "home",
        PYTHONPATH=os.pathsep.join([ROOT, TESTS]),
        RAY_USAGE_STATS_ENABLED="0",
        TF_CPP_MIN_LOG_LEVEL="3",
        # Ray's single-machine mode: its node address stays 127.0.0.1 (otherwise
        # Ray trades a loopback --node-ip-address for the machine's own address).
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
    )
    # Ray's socket paths (TEMP/session_<date>_<pid>/sockets/plasma_store) must fit AF_UNIX's
    # 107 bytes: under the module's tmp dir when it is short enough (pytest's own, outside
    # xdist), else a short directory of /tmp, removed at the end.
    temp = str(base / "t")
    short = len(temp) > 44
    if short:
        temp = tempfile.mkdtemp(prefix="ray-")
    log = open(base / "ray_start.log", "w")
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(port),
        "--num-cpus",
        "2",
        "--num-gpus",
        "0",
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--ray-client-server-port",
        str(free_port()),
        "--object-store-memory",
        str(200 << 20),
        "--temp-dir",
        temp,
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    address = f"127.0.0.1:{port}"
    try:
        started = wait_for(
            lambda: (
                proc.poll() is not None
                or "Ray runtime started" in open(base / "ray_start.log").read()
            ),
            120,
        )
        assert started and proc.poll() is None, open(base / "ray_start.log").read()[-3000:]
        # This driver in the same single-machine mode (Ray reads the variable when imported,
        # as this module imports it: its constant is set for the module's time).
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
            ray.init(address=address, log_to_driver=False)
            yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            proc.wait(30 * TIME_SCALE)
        except subprocess.TimeoutExpired:
            pass
        for pid in session_pids(proc.pid):  # what did not stop
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)
        log.close()
        if short:
            shutil.rmtree(temp, ignore_errors=True)
        left = wait_for(lambda: not session_pids(proc.pid), 10) is not None
        assert left, f"processes of the Ray cluster still running: {session_pids(proc.pid)}"


def train_on_ray(fn, timeout=180):
    """``fn`` on two Horovod workers started by RayExecutor; their answers, by rank."""
    from horovod.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    executor = RayExecutor(settings, num_workers=2, cpus_per_worker=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            executor.start()
        answers = ray.get(executor.run_remote(fn), timeout=timeout * TIME_SCALE)
    finally:
        executor.shutdown()
    # Ray 2's APIs only: Horovod 0.28.1 as released placed its workers with options Ray
    # deprecated (placement_group=...), warnings at each start (the ray2 patch).
    assert [str(w.message) for w in caught if "deprecated" in str(w.message).lower()] == []
    return sorted(answers, key=lambda a: a["rank"])


def one_process(kind, timeout=120):
    import ray_train

    return ray.get(
        ray.remote(num_cpus=1)(ray_train.reference).remote(kind), timeout=timeout * TIME_SCALE
    )


def weights(answer):
    return np.concatenate([np.ravel(w) for w in answer["weights"]])


def check(kind, answers, ref):
    assert [a["rank"] for a in answers] == [0, 1] and {a["size"] for a in answers} == {2}
    assert {a["keras"] for a in answers} == {ref["keras"]} == {keras_flavour()}
    w0, w1 = weights(answers[0]), weights(answers[1])
    assert np.array_equal(w0, w1), (w0, w1)  # the ranks in step
    # trained (far from the start), and the steps of one process on the whole batch
    assert np.abs(weights(ref) - np.concatenate([np.ravel(w) for w in ref["initial"]])).max() > 0.1
    assert np.abs(w0 - weights(ref)).max() < EXACT, (kind, w0, weights(ref))


@pytest.mark.keras2
def test_gradient_tape_on_two_ray_workers(cluster):
    import ray_train

    answers = train_on_ray(ray_train.gradient_tape)
    check("gradient_tape", answers, one_process("gradient_tape"))


@pytest.mark.keras2
def test_keras_fit_on_two_ray_workers(cluster):
    import ray_train

    answers = train_on_ray(ray_train.keras_fit)
    check("keras_fit", answers, one_process("keras_fit"))


# --- hvdtrain.ray: hvdtrain's own front, on the same cluster ------------------------------


def driver_env(tmp_path):
    """A driver's environment for this module's cluster (on loopback: Ray's single-machine
    mode, read when Ray is imported)."""
    return clean_env(
        tmp_path / "home",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        PYTHONPATH=os.pathsep.join([ROOT, TESTS]),
    )


def ray_cmd(address, *args):
    return [sys.executable, "-m", "hvdtrain.ray", "--address", address, *map(str, args)]


def test_a_killed_rank_restarts_the_job_which_ends_with_horovodruns_weights(
    cluster, tmp_path, references
):
    """The linear task through ``python -m hvdtrain.ray`` on 2 workers; rank 1's process
    SIGKILLed after the first checkpoint: the driver says so in one line, starts the job
    again, and it resumes to the weights of the same job under horovodrun, uninterrupted."""
    ref = references.run("gloo", 2, "linear", *LINEAR)
    run_dir = tmp_path / "run"
    rc, out, err = lose_after_first_checkpoint(
        ray_cmd(cluster, "--num-workers", 2, "linear", *LINEAR, "--run-dir", run_dir),
        driver_env(tmp_path),
        run_dir,
        lambda pids: os.kill(pids[1], signal.SIGKILL),
        180,
    )
    assert rc == 0, err[-3000:]
    # The line the Ray page shows, with this host's name.
    (shown,) = block(
        "guides/clusters/ray.md", "hvdtrain.ray: rank 1 on node2 was killed"
    ).text.splitlines()
    lines = [l for l in err.splitlines() if l.startswith("hvdtrain.ray: rank 1 on ")]
    assert lines == [shown.replace("node2", socket.gethostname())], err[-3000:]
    assert "resumed from" in err, err[-3000:]
    r = result(run_dir)
    assert (r["world_size"], r["global_step"]) == (2, ref["global_step"]), err[-3000:]
    assert r["weights_sha256"] == ref["weights_sha256"], err[-3000:]


def test_sigterm_to_the_driver_saves_and_75_then_the_same_command_resumes(
    cluster, tmp_path, references
):
    ref = references.run("gloo", 2, "linear", *LINEAR)
    run_dir = tmp_path / "run"
    cmd = ray_cmd(cluster, "--num-workers", 2, "linear", *LINEAR, "--run-dir", run_dir)
    proc = start(cmd, driver_env(tmp_path))
    try:
        assert wait_for(lambda: checkpoints(run_dir), 120), "no checkpoint appeared"
        os.kill(proc.pid, signal.SIGTERM)
        rc, out, err = finish(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 75, err[-3000:]
    lines = [l for l in err.splitlines() if "stopped by SIGTERM at step" in l]
    assert len(lines) == 1 and lines[0].startswith("python -m hvdtrain.ray linear: "), err
    step = int(lines[0].split("at step ")[1].split(";")[0])
    assert checkpoints(run_dir)[0][0] == step < ref["global_step"]
    assert not rank_pids(str(run_dir))  # the ranks are gone with it
    p = run(cmd, driver_env(tmp_path), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"step {step}" in p.stderr and "resumed from" in p.stderr
    assert result(run_dir)["weights_sha256"] == ref["weights_sha256"]


def test_the_python_call_returns_rank_0s_value_and_a_tasks_result(cluster, tmp_path):
    """``hvdtrain.ray.run`` from a Python process already connected to Ray (a notebook's):
    a function on 3 ranks returns rank 0's value, computed with the world hvdtrain made
    there; a Task instance returns its result.json; a function that raises on one rank is a
    RayJobError with status 1, after that rank's traceback."""
    import hvdtrain.ray
    import ray_train
    from hvdtrain.tasks.linear import LinearTask

    value = hvdtrain.ray.run(ray_train.world_sum, args=[2.0], num_workers=2)
    assert (value["rank"], value["size"], value["sum"]) == (0, 2, 2.0 * (1 + 2))
    assert value["pid"] != os.getpid()
    run_dir = tmp_path / "run"
    res = hvdtrain.ray.run(
        LinearTask(), argv=["--epochs", "2", "--run-dir", str(run_dir)], num_workers=2
    )
    assert res == result(run_dir) and res["world_size"] == 2 and res["epochs"] == 2
    with pytest.raises(hvdtrain.ray.RayJobError) as e:
        hvdtrain.ray.run(ray_train.fails, args=[1], num_workers=2)
    assert e.value.status == 1


def test_bad_input_is_one_line_before_any_worker_starts(cluster, tmp_path):
    env = driver_env(tmp_path)
    cases = [
        (["linear", "--epochs", "0"], 2, "hvdtrain.ray linear: error: --epochs=0: must be"),
        (["nosuchtask"], 2, "'nosuchtask'"),
        (["--num-workers", "0", "linear"], 2, "num_workers=0: must be an integer of at least 1"),
        (["no_such_script.py"], 2, "no_such_script.py: no such script"),
        (
            ["--num-workers", "2", "--min-workers", "1", "linear"],
            2,
            "num_workers or min_workers/max_workers: a job is elastic or not",
        ),
        (
            ["--min-workers", "3", "--max-workers", "2", "linear"],
            2,
            "max_workers=2: must be at least min_workers=3",
        ),
        (
            ["--cpus-per-worker", "64", "--placement-timeout", "3", "linear"],
            1,
            "the Ray cluster has no room for 2 workers of 64 CPU each within 3 s",
        ),
    ]
    for args, status, said in cases:
        p = run(ray_cmd(cluster, *args), env, timeout=90)
        err = [l for l in p.stderr.splitlines() if "WARNING" not in l]
        assert p.returncode == status and said in p.stderr, (args, p.returncode, p.stderr)
        assert len(err) == 1, (args, p.stderr)
