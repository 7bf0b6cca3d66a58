"""A new user's first minute, on the raw output (not conftest's NOISE-filtered one): setup's
Horovod check says nothing when Horovod is absent, and a start on a machine without a GPU
prints hvdtrain's own lines first, in one process and in every rank."""

import os
import re
import signal
import subprocess
import sys

import pytest

import rank_env
from conftest import HOROVODRUN, ROOT, clean_env, result
from hvdtrain.base import tflogs

SETUP = os.path.join(ROOT, "scripts", "setup.sh")


def raw(cmd, env, timeout=120):
    """(returncode, stdout, stderr) exactly as written; the whole group killed on time-out."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{out}\n{err}")
    return proc.returncode, out, err


def quiet_env(tmp_path, **extra):
    """A user's environment: no TF_CPP_MIN_LOG_LEVEL of the tests' own (hvdtrain sets 2)."""
    env = clean_env(tmp_path / "home")
    env.pop("TF_CPP_MIN_LOG_LEVEL")
    env.pop("HVDTRAIN_TF_LOGS", None)
    return dict(env, **{k: str(v) for k, v in extra.items()})


# --- scripts/setup.sh's Horovod check ---------------------------------------------------------


@pytest.mark.parametrize("horovod", ["absent", "a stub without horovod.tensorflow"])
def test_setup_horovod_check_without_horovod_is_silent(tmp_path, horovod):
    venv = tmp_path / "venv"
    subprocess.run(
        [
            getattr(sys, "_base_executable", sys.executable),
            "-m",
            "venv",
            "--without-pip",
            str(venv),
        ],
        check=True,
        timeout=60,
    )
    if horovod != "absent":
        site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        (site / "horovod").mkdir(parents=True)
        (site / "horovod" / "__init__.py").write_text('__version__ = "0.28.1"\n')
    rc, out, err = raw(
        ["bash", SETUP, "--check-horovod"], dict(os.environ, HVDTRAIN_VENV=str(venv)), timeout=60
    )
    assert (rc, out, err) == (1, "", "")  # "rebuild", and nothing else: no traceback


def test_setup_horovod_check_passes_on_this_venv():
    """The same check on the venv running these tests (built by scripts/setup.sh): current."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    rc, out, err = raw(
        ["bash", SETUP, "--check-horovod"], dict(os.environ, HVDTRAIN_VENV=venv), timeout=120
    )
    assert (rc, out, err) == (0, "", "")


@pytest.mark.quick
def test_setup_rejects_an_unknown_argument():
    rc, out, err = raw(["bash", SETUP, "--chek-horovod"], dict(os.environ), timeout=30)
    assert rc == 1 and out == ""
    assert err == (
        "[setup] error: unknown argument --chek-horovod (scripts/setup.sh takes none, "
        "--wheels DIR, --horovod-only or --check-horovod)\n"
    )


# --- TensorFlow's start-up lines ----------------------------------------------------------------

# What TensorFlow 2.21 wrote to stderr on this project's machines (no GPU, no NVIDIA driver)
# while it was imported and listed its devices, with hvdtrain's TF_CPP_MIN_LOG_LEVEL=2.
NO_GPU_START = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796089939.436078   11136 port.cc:153] oneDNN custom operations are on. You may see \
slightly different numerical results due to floating-point round-off errors from different \
computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.
I0000 00:00:1796089939.436356   11136 cudart_stub.cc:31] Could not find cuda drivers on your \
machine, GPU will not be used.
I0000 00:00:1796089939.469382   11136 cpu_feature_guard.cc:227] This TensorFlow binary is \
optimized to use available CPU instructions in performance-critical operations.
To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 AVX_VNNI FMA, in other \
operations, rebuild TensorFlow with the appropriate compiler flags.
E0000 00:00:1796089941.656486   11136 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA \
error: Failed call to cuInit: UNKNOWN ERROR (303)
"""
CUINIT = NO_GPU_START.splitlines(keepends=True)[-1]
OTHER = (
    "W0000 00:00:1796089941.7 11136 some_op.cc:12] a warning of TensorFlow's own\n"
    "/x.py:3: DeprecationWarning: a Python warning\n"
)


@pytest.mark.quick
def test_only_the_known_start_up_lines_are_held_back():
    assert tflogs.kept_lines(NO_GPU_START) == ""
    assert tflogs.kept_lines(NO_GPU_START + OTHER) == OTHER
    # A driver that is there but fails: cuInit's error is shown.
    assert tflogs.kept_lines(OTHER + CUINIT) == OTHER + CUINIT
    assert tflogs.kept_lines("no newline at the end") == "no newline at the end"


@pytest.mark.parametrize(
    "environ, held",
    [
        ({"TF_CPP_MIN_LOG_LEVEL": "2"}, True),
        ({"TF_CPP_MIN_LOG_LEVEL": "3"}, True),
        ({"TF_CPP_MIN_LOG_LEVEL": "1"}, False),
        ({"TF_CPP_MIN_LOG_LEVEL": "0"}, False),
        ({}, False),  # hvdtrain sets 2 before it asks; unset means TensorFlow's 0
        ({"TF_CPP_MIN_LOG_LEVEL": "2", "HVDTRAIN_TF_LOGS": "1"}, False),
        ({"TF_CPP_MIN_LOG_LEVEL": "2", "HVDTRAIN_TF_LOGS": "0"}, True),
    ],
)
@pytest.mark.quick
def test_which_environment_holds_them_back(environ, held):
    assert tflogs.wanted(environ) is held


def test_one_process_starts_with_hvdtrains_own_line(tmp_path):
    """python -m hvdtrain.linear, no launcher: nothing on stderr at all (no TensorFlow lines,
    no worker-count warning), and stdout starts with hvdtrain's line."""
    rc, out, err = raw(
        [
            sys.executable,
            "-m",
            "hvdtrain.linear",
            "--run-dir",
            str(tmp_path / "r"),
            "--epochs",
            "1",
        ],
        quiet_env(tmp_path),
    )
    assert rc == 0 and err == "", err
    assert out.splitlines()[0].startswith("hvdtrain: linear on 1 process, Horovod over ")
    assert result(tmp_path / "r")["world_size"] == 1
    # An "is it installed?" before the import does not spoil it.
    code = "import hvdtrain, importlib.util; importlib.util.find_spec('tensorflow'); import keras"
    assert raw([sys.executable, "-c", code], quiet_env(tmp_path)) == (0, "", "")
    # The lines are real, and HVDTRAIN_TF_LOGS=1 shows them again.
    rc, out, err = raw(
        [sys.executable, "-c", "import hvdtrain, tensorflow"],
        quiet_env(tmp_path, HVDTRAIN_TF_LOGS=1),
    )
    assert rc == 0 and tflogs._ABSL_NOTE in err.splitlines(), err


RANK_LINE = re.compile(r"^\[[\d,]+\]<(stdout|stderr)>:(.*)$")


def test_every_rank_starts_with_hvdtrains_own_line(tmp_path):
    """horovodrun -np 2 python -m hvdtrain.mnist: no rank prints a TensorFlow line. horovodrun
    itself imports horovod.tensorflow in a child to ask how Horovod was built: its lines, with
    no rank prefix, are TensorFlow's start-up lines and nothing else (named in
    docs/reference/startup-lines.md)."""
    rc, out, err = raw(
        [
            HOROVODRUN,
            "-np",
            "2",
            sys.executable,
            "-m",
            "hvdtrain.mnist",
            "--epochs",
            "1",
            "--no-download",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        quiet_env(tmp_path),
        timeout=180,
    )
    assert rc == 0, out + err
    ranks = [RANK_LINE.match(l) for l in (out + err).splitlines() if RANK_LINE.match(l)]
    texts = [m[2] for m in ranks if m[2]]
    assert texts[0].startswith("hvdtrain: no MNIST found") and "mnist on 2 processes" in texts[1]
    assert all(t.startswith(("hvdtrain: ", "Epoch 1/1 ", "Test accuracy: ")) for t in texts), texts
    assert not any("--num-workers" in t for t in texts)  # mnist's 2 is the launcher's 2
    launcher = "".join(l for l in (out + err).splitlines(keepends=True) if not RANK_LINE.match(l))
    assert tflogs.kept_lines(launcher) == "", launcher
    assert result(tmp_path / "r")["world_size"] == 2


def test_a_launcher_with_another_count_is_warned_about_once(tmp_path):
    """linear's --num-workers is 2; the no-launcher run above is not warned about, this is."""
    rc, out, err = raw(
        [
            HOROVODRUN,
            "-np",
            "1",
            "--gloo",
            sys.executable,
            "-m",
            "hvdtrain.linear",
            "--epochs",
            "1",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        quiet_env(tmp_path),
    )
    assert rc == 0, out + err
    warnings = [l for l in err.splitlines() if "--num-workers" in l]
    assert warnings == [
        "[0]<stderr>:hvdtrain: warning: --num-workers is 2 but the launcher "
        "started 1 process(es); training with world size 1"
    ]


def test_launch_local_starts_the_configured_worker_count_quietly(tmp_path):
    """scripts/launch_local.sh starts linear's configured 2 workers, and drops horovodrun's
    own TensorFlow lines too; the workers start with glibc's huge-page tunable from it."""
    rc, out, err = raw(
        [
            "bash",
            os.path.join(ROOT, "scripts", "launch_local.sh"),
            "linear",
            "--epochs",
            "3",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        rank_env.logging(quiet_env(tmp_path, PYTHON=sys.executable), tmp_path),
    )
    assert rc == 0, out + err  # it trained ...
    assert err == "", err  # ... and said nothing on stderr
    assert RANK_LINE.match(out.splitlines()[0])[2].startswith("hvdtrain: linear on 2 processes")
    r = result(tmp_path / "r")
    assert r["world_size"] == 2 and r["global_step"] == 3
    rank_env.assert_launcher_set_it(tmp_path, 2)


def test_launch_cluster_with_a_hostfile_trains_quietly(tmp_path):
    """scripts/launch_cluster.sh with a hostfile (no IFACE: test_multihost sets one) trains to
    the seed's weights, and forwards only the variables that are set: Open MPI warned about
    each unset one (LD_LIBRARY_PATH, TF_CPP_MIN_LOG_LEVEL, ...) before the first line. The
    ranks start with glibc's huge-page tunable from it."""
    import numpy as np

    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    env = rank_env.logging(quiet_env(tmp_path, PYTHON=sys.executable), tmp_path)
    for name in ("LD_LIBRARY_PATH", "HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "IFACE"):
        env.pop(name, None)
    rc, out, err = raw(
        [
            "bash",
            os.path.join(ROOT, "scripts", "launch_cluster.sh"),
            str(hostfile),
            "linear",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        env,
    )
    assert rc == 0, out + err
    assert err == "", err
    assert out.splitlines()[0].startswith("hvdtrain: linear on 2 processes")
    r = result(tmp_path / "r")
    assert r["world_size"] == 2
    np.testing.assert_allclose(r["weights"], [0.1, 0.2, 0.3], atol=1e-3)
    rank_env.assert_launcher_set_it(tmp_path, 2)
