"""Shared helpers: run hvdtrain as a user would (python -m, horovodrun, mpirun) with bounds.

Every process a test starts runs in its own session and is killed, with its children,
when the test's time bound passes, so a hang fails the test instead of the suite.
"""
import json
import os
import signal
import subprocess
import sys

import pytest

BIN = os.path.dirname(sys.executable)
HOROVODRUN = os.path.join(BIN, "horovodrun")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = ("cuda", "absl::", "E0000", "cpu_feature_guard", "oneDNN", "AVX", "cuInit",
         "rebuild TensorFlow")


def clean_env(home, **extra):
    env = dict(os.environ)
    # No Keras cache, no download attempt: tests never depend on this machine's state.
    env.update(HOME=str(home), PATH=BIN + os.pathsep + env.get("PATH", ""),
               PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    for name in ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE", "TF_USE_LEGACY_KERAS"):
        env.pop(name, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, env, timeout=180, cwd=None):
    """Run ``cmd``; kill its whole process group after ``timeout`` seconds."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{out}\n{err}")
    err = "\n".join(l for l in err.splitlines() if not any(n in l for n in NOISE))
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def module_cmd(task, *args):
    return [sys.executable, "-m", f"hvdtrain.{task}", *args]


def launch(launcher, np, task, *args):
    """The command line of a real multi-process launch."""
    if launcher == "mpirun":
        return ["mpirun", "-np", str(np), "--allow-run-as-root", "--oversubscribe",
                "--bind-to", "none", *module_cmd(task, *args)]
    controller = {"gloo": "--gloo", "mpi": "--mpi"}[launcher]
    return [HOROVODRUN, "-np", str(np), controller, *module_cmd(task, *args)]


def result(run_dir):
    with open(os.path.join(run_dir, "result.json")) as f:
        return json.load(f)


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "home")
