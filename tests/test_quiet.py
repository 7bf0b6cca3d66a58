"""A new user's first minute, on the raw output (not conftest's NOISE-filtered one): setup's
Horovod check says nothing when Horovod is absent, and a start on a machine without a GPU
prints hvdtrain's own lines first, in one process and in every rank."""
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env

SETUP = os.path.join(ROOT, "scripts", "setup.sh")


def raw(cmd, env, timeout=120):
    """(returncode, stdout, stderr) exactly as written; the whole group killed on time-out."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{out}\n{err}")
    return proc.returncode, out, err


def quiet_env(tmp_path, **extra):
    """A user's environment: no TF_CPP_MIN_LOG_LEVEL of the tests' own (hvdtrain sets 2)."""
    env = clean_env(tmp_path / "home", **extra)
    env.pop("TF_CPP_MIN_LOG_LEVEL")
    env.pop("HVDTRAIN_TF_LOGS", None)
    return env


# --- scripts/setup.sh's Horovod check ---------------------------------------------------------

@pytest.mark.parametrize("horovod", ["absent", "a stub without horovod.tensorflow"])
def test_setup_horovod_check_without_horovod_is_silent(tmp_path, horovod):
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv",
                    "--without-pip", str(venv)], check=True, timeout=60)
    if horovod != "absent":
        site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        (site / "horovod").mkdir(parents=True)
        (site / "horovod" / "__init__.py").write_text('__version__ = "0.28.1"\n')
    rc, out, err = raw(["bash", SETUP, "--check-horovod"], dict(os.environ, HVDTRAIN_VENV=str(venv)),
                       timeout=60)
    assert (rc, out, err) == (1, "", "")  # "rebuild", and nothing else: no traceback


def test_setup_horovod_check_passes_on_this_venv():
    """The same check on the venv running these tests (built by scripts/setup.sh): current."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    rc, out, err = raw(["bash", SETUP, "--check-horovod"], dict(os.environ, HVDTRAIN_VENV=venv),
                       timeout=120)
    assert (rc, out, err) == (0, "", "")


def test_setup_rejects_an_unknown_argument():
    rc, out, err = raw(["bash", SETUP, "--chek-horovod"], dict(os.environ), timeout=30)
    assert rc == 1 and out == ""
    assert err == ("[setup] error: unknown argument --chek-horovod (scripts/setup.sh takes none, "
                   "or --check-horovod)\n")
