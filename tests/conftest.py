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
KERAS2 = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
NOISE = ("cuda", "absl::", "E0000", "cpu_feature_guard", "oneDNN", "AVX", "cuInit",
         "rebuild TensorFlow")


def clean_env(home, **extra):
    env = dict(os.environ)
    # No Keras cache, no download attempt: tests never depend on this machine's state.
    env.update(HOME=str(home), PATH=BIN + os.pathsep + env.get("PATH", ""),
               PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    for name in ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE", "KERAS_BACKEND"):
        env.pop(name, None)
    # Keras 3 unless this pytest runs the Keras 2 pass (TF_USE_LEGACY_KERAS=1 pytest -m keras2,
    # which scripts/test.sh does): its children then train on tf_keras too.
    if not KERAS2:
        env.pop("TF_USE_LEGACY_KERAS", None)
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


def keras_flavour():
    """The Keras the tests' children train with: "keras" (3) or "tf_keras" (2)."""
    return "tf_keras" if KERAS2 else "keras"


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "home")


def rank_pids(marker):
    """{rank: pid} of the training processes whose command line contains ``marker``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        # A rank: python running hvdtrain (-m hvdtrain.<task>) or a script; the launcher is
        # python too, but has no rank in its environment.
        if (len(args) < 2 or not os.path.basename(args[0]).startswith("python")
                or not any(marker in a for a in args)):
            continue
        env = dict(e.decode(errors="replace").split("=", 1) for e in environ if b"=" in e)
        rank = env.get("HOROVOD_RANK", env.get("OMPI_COMM_WORLD_RANK"))
        if rank is not None:
            found[int(rank)] = int(entry)
    return found


def wait_for(predicate, timeout, interval=0.05):
    """Poll until ``predicate()`` is truthy; return its value, or None after ``timeout``."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def start(cmd, env):
    """Start ``cmd`` in its own session (stdout/stderr to pipes); pair with ``finish``."""
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc, timeout):
    """Wait up to ``timeout`` s; on time-out kill the whole group. Returns (rc or None, out, err)."""
    try:
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    err = "\n".join(l for l in err.splitlines() if not any(n in l for n in NOISE))
    return rc, out, err


def script_cmd(np, script, *args):
    """``python SCRIPT args`` as a user runs it, under ``horovodrun -np N --gloo`` when N > 1."""
    cmd = [sys.executable, str(script), *map(str, args)]
    return cmd if np == 1 else [HOROVODRUN, "-np", str(np), "--gloo", *cmd]


def launch_example(np, name, *args):
    """examples/<name>, alone (np 1) or under horovodrun."""
    return script_cmd(np, os.path.join(ROOT, "examples", name), *args)


