"""Shared helpers: run hvdtrain as a user would (python -m, horovodrun, mpirun) with bounds.

Every process a test starts runs in its own session and is killed, with its children,
when the test's time bound passes, so a hang fails the test instead of the suite.
"""

import glob
import json
import os
import shlex
import signal
import sys

import pytest

from hvdtrain.bench import harness
from hvdtrain.bench.harness import BIN, HOROVODRUN, ROOT, start  # noqa: F401 (the tests' names)
from hvdtrain.distributed import World

# A run started as a background job of a script (`pytest ... &`, as CI may start it) inherits
# SIGINT and SIGQUIT ignored, and so would every process a test starts: a shell cannot trap a
# signal ignored at its start, so a launch script's Ctrl-C handling would go untested (its job
# ran to its end). The tests' commands get what a terminal gives them: the default.
for _signum in (signal.SIGINT, signal.SIGQUIT):
    if signal.getsignal(_signum) == signal.SIG_IGN:
        signal.signal(
            _signum, signal.default_int_handler if _signum == signal.SIGINT else signal.SIG_DFL
        )

KERAS2 = os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")
# Every time bound a test sets (pytest-timeout's per-test bound, and each process's below) is
# multiplied by this: a slower or busier machine than the 2 cores the bounds were set on.
TIME_SCALE = float(os.environ.get("HVDTRAIN_TEST_TIME_SCALE", "1") or 1)
NOISE = (
    "cuda",
    "absl::",
    "E0000",
    "cpu_feature_guard",
    "oneDNN",
    "AVX",
    "cuInit",
    "rebuild TensorFlow",
)


# A command prefix: root without its power over file permissions (CAP_DAC_OVERRIDE and
# CAP_DAC_READ_SEARCH leave the bounding set, for the command and all it starts), so that a
# file's mode bits apply to it as they do to any user; nothing for another user, whom they
# apply to already. CI and the containers run as root.
NO_DAC = (
    ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
)


# The fault tests' linear job (faults/test_faults.py; SLURM's "long" reference runs it too):
# linear, far from converged at the end (lr 5e-4, 1,000 small steps), so equal weights mean
# equal trajectories, not two runs that both reached [0.1, 0.2, 0.3].
LINEAR_EPOCHS = 10
LINEAR = [
    "--batch-size",
    "5",
    "--epochs",
    str(LINEAR_EPOCHS),
    "--learning-rate",
    "0.0005",
    "--checkpoint-every",
    "100",
    "--verbose",
    "0",
]


class FakeWorld(World):
    """Rank 0 of a world whose allgather answers with this rank's object followed by
    ``others`` (the other ranks' answers): the agreement checks, in one process."""

    def __init__(self, others):
        super().__init__()
        self.others = others

    def allgather_object(self, obj):
        return [obj] + self.others


# The packages this venv has for the test, track, bench and Spark extras that an install of
# hvdtrain alone lacks, and that Keras 3 and TensorFlow import at start-up when they are there
# (scikit-learn for Keras' wrappers, with SciPy; pandas and pyarrow for its data adapters;
# matplotlib for its visualization): about a third of each launched process's start-up CPU
# (1.2 of 3.7 s here). tests/base_install/ holds a package of each name that raises
# ImportError, first on the PYTHONPATH of what the tests launch, so those processes start as
# on a user's base install; a test whose processes use them (tracking, Spark, the bench's
# plots) asks clean_env(extras=True).
BASE_INSTALL = os.path.join(ROOT, "tests", "base_install")


def clean_env(home, extras=False, **extra):
    # No Keras cache, no download attempt: tests never depend on this machine's state.
    env = harness.environment(HOME=str(home))
    env["PYTHONPATH"] = ROOT if extras else ROOT + os.pathsep + BASE_INSTALL
    env.pop("KERAS_BACKEND", None)
    # glibc's huge-page tunable as hvdtrain decides it, whatever this shell exported.
    for name in ("GLIBC_TUNABLES", "HVDTRAIN_HUGETLB", "HVDTRAIN_HUGETLB_REEXEC"):
        env.pop(name, None)
    # Keras 3 unless this pytest runs the Keras 2 pass (TF_USE_LEGACY_KERAS=1 pytest -m keras2,
    # which scripts/test.sh does): its children then train on tf_keras too.
    if not KERAS2:
        env.pop("TF_USE_LEGACY_KERAS", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


# pytest-xdist (scripts/test.sh runs the suite on HVDTRAIN_TEST_WORKERS workers, --dist
# loadgroup): each module is one group, so its module-scoped launches run once, on one worker.
# These modules are one group together: they compare against the same session references
# (faults/test_faults' linear run, the multi-host one), and the ones that build network
# namespaces, daemons and pods (multi-host, SLURM, Kubernetes) never run beside each other.
# The Ray and Spark clusters (each its own subnet and namespaces, no references) are groups
# of their own: they may run beside them.
SHARED = {
    "test_faults": "references",
    "test_storage": "references",
    "test_multiprocess": "references",
    "test_multihost": "references",
    "test_slurm": "references",
    "test_k8s": "references",
    "test_ray_cluster": "ray_cluster",
    "test_spark_cluster": "spark_cluster",
}
LONGEST = (
    "references",
    "test_keras_fit_patterns",
    "test_pipeline",
    "test_mixed_precision",
    "test_bench",
    "test_accumulate",
    "test_models",
    "test_no_silent_failure",
    "test_watchdog",
    "test_horovod_api",
    "test_wheels",
)
# The tiers are tests/'s folders; each test gets its folder's marker (pytest -m runs, ...).
# The helpers (this file, the clusters' harnesses, the scripts the tests launch) stay here,
# importable from every folder (pythonpath, in pyproject.toml's pytest settings).
TESTS = os.path.dirname(os.path.abspath(__file__))
TIERS = ("unit", "runs", "faults", "clusters")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group into the test's id
def pytest_collection_modifyitems(config, items):
    """Each test's tier marker and xdist group (above); HVDTRAIN_TEST_TIME_SCALE: each test's
    pytest-timeout bound (its own marker's, or pyproject.toml's) times the scale."""
    groups = {}
    for item in items:
        tier = os.path.relpath(item.path, TESTS).split(os.sep)[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        module = item.path.stem
        groups[item] = SHARED.get(module, module)
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    # The longest groups first (xdist hands out groups in this order), so that no worker
    # starts a long one while the other is finishing: a stable sort, each module's own order
    # kept. The longest in CI's run (both passes), longest first.
    items.sort(
        key=lambda item: LONGEST.index(groups[item]) if groups[item] in LONGEST else len(LONGEST)
    )
    # The bench tier (the bench's own cases through their launchers, beyond the smoke that
    # runs with the suite) runs only when named: pytest -m bench; scripts/test.sh skips it.
    if "bench" not in (config.option.markexpr or ""):
        for item in items:
            if item.get_closest_marker("bench"):
                item.add_marker(pytest.mark.skip(reason="the bench tier: pytest -m bench"))
    if TIME_SCALE == 1:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        bound = float(marker.args[0]) if marker and marker.args else default
        if bound:
            item.add_marker(pytest.mark.timeout(bound * TIME_SCALE), append=False)


def _quiet(err: str) -> str:
    return "\n".join(l for l in err.splitlines() if not any(n in l for n in NOISE))


def run(cmd, env, timeout=180, cwd=None):
    """Run ``cmd``; kill its whole process group after ``timeout`` seconds."""
    try:
        proc = harness.run(cmd, env, timeout * TIME_SCALE, cwd)
    except harness.Timeout as e:
        pytest.fail(f"{e}\n{e.out}\n{e.err}")
    proc.stderr = _quiet(proc.stderr)
    return proc


def module_cmd(task, *args):
    return harness.python(f"hvdtrain.{task}", *args)


def launch(launcher, np, task, *args):
    """The command line of a real multi-process launch."""
    if launcher == "mpirun":
        return harness.mpirun(np, module_cmd(task, *args))
    return harness.horovodrun(np, {"gloo": "gloo", "mpi": "mpi"}[launcher], module_cmd(task, *args))


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
        if (
            len(args) < 2
            or not os.path.basename(args[0]).startswith("python")
            or not any(marker in a for a in args)
        ):
            continue
        env = dict(e.decode(errors="replace").split("=", 1) for e in environ if b"=" in e)
        rank = env.get("HOROVOD_RANK", env.get("OMPI_COMM_WORLD_RANK"))
        if rank is not None:
            found[int(rank)] = int(entry)
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server a test starts)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def running(pid) -> bool:
    """Whether process ``pid`` exists and is not a zombie; a process that ends between two
    reads of /proc (ProcessLookupError, FileNotFoundError) is not running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command's name, which may hold spaces and parentheses.
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, timeout, interval=0.05):
    """Poll until ``predicate()`` is truthy; return its value, or None after ``timeout``."""
    import time

    deadline = time.monotonic() + timeout * TIME_SCALE
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def finish(proc, timeout):
    """Wait up to ``timeout`` s; on time-out kill the whole group. Returns (rc or None, out, err)."""
    rc, out, err = harness.finish(proc, timeout * TIME_SCALE)
    return rc, out, _quiet(err)


def script_cmd(np, script, *args):
    """``python SCRIPT args`` as a user runs it, under ``horovodrun -np N --gloo`` when N > 1."""
    cmd = [sys.executable, str(script), *map(str, args)]
    return cmd if np == 1 else [HOROVODRUN, "-np", str(np), "--gloo", *cmd]


def launch_example(np, name, *args):
    """examples/<name>, alone (np 1) or under horovodrun."""
    return script_cmd(np, os.path.join(ROOT, "examples", name), *args)


def as_printed(line):
    """A documented command line (``docs_pages.Block.commands()``) as a shell splits it. Its
    ``python``, ``horovodrun`` and ``mpirun`` are the PATH's: clean_env puts this venv's
    first, as ``source .venv/bin/activate`` does."""
    return shlex.split(line)


def checkout_like(path):
    """``path`` made a directory in which a documented command that names the checkout's
    files (``examples/...``, ``scripts/...``) runs as in the checkout: those two folders linked
    from it, nothing else, so what the command writes (``runs/...``) stays in ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "scripts"):
        os.symlink(os.path.join(ROOT, name), path / name)
    return path


def default_run_dirs(cwd, task):
    """The run directories a run without --run-dir made in ``cwd``: runs/<task>-<time>."""
    return sorted(glob.glob(os.path.join(glob.escape(str(cwd)), "runs", f"{task}-*")))


class References:
    """Uninterrupted runs computed once per session and shared by every test (of any module)
    that compares against the same command: ``references.run("gloo", 2, "linear", *args)``
    launches it the first time and returns its result.json (``references.run_dir(...)``: its
    run directory) every time. The key is the launcher, the ranks, the task and its flags."""

    def __init__(self, base):
        self.base, self.done = base, {}

    def run_dir(self, launcher, np, task, *args):
        key = (launcher, np, task, *map(str, args))
        if key not in self.done:
            run_dir = self.base / f"ref{len(self.done)}"
            cmd = module_cmd(task, *args) if np == 1 else launch(launcher, np, task, *args)
            p = run([*cmd, "--run-dir", str(run_dir)], clean_env(self.base / "home"), timeout=300)
            assert p.returncode == 0, f"reference run {key} failed:\n{p.stderr[-3000:]}"
            self.done[key] = run_dir
        return self.done[key]

    def run(self, launcher, np, task, *args):
        return result(self.run_dir(launcher, np, task, *args))

    def printed(self, line):
        """A documented command line run as printed (``as_printed``), in a directory of its
        own (``checkout_like``), the first time; (its finished process, that directory)
        every time. The README's main command is the two-host runs' reference too."""
        if line not in self.done:
            cwd = checkout_like(self.base / f"printed{len(self.done)}")
            proc = run(as_printed(line), clean_env(self.base / "home"), timeout=300, cwd=cwd)
            self.done[line] = (proc, cwd)
        return self.done[line]


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    return References(tmp_path_factory.mktemp("references"))


@pytest.fixture
def no_horovod(tmp_path):
    """An environment where ``import horovod`` fails as it does when it is not installed."""
    shim = tmp_path / "shim" / "horovod"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'horovod'\")\n")
    return clean_env(tmp_path / "home", PYTHONPATH=f"{shim.parent}:{ROOT}")


def checkpoints(run_dir):
    """(global step, path) of the run directory's checkpoints, newest first."""
    from hvdtrain.engine import checkpoint_file

    return checkpoint_file.list_checkpoints(os.path.join(run_dir, "checkpoints"))


class Lazy(dict):
    """``Lazy(make)[key]``: ``make(key)`` the first time a key is read, kept for the next
    reads (a module's shared launches, made only if a test of this pass reads them)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


def kill_when(cmd, env, run_dir, ready, timeout=120, what="no checkpoint appeared"):
    """Start a job, SIGKILL all of it once ``ready()`` is truthy (``what``: the failure if it
    never is); the job must not have finished by then."""
    import signal

    proc = start(cmd, env)
    try:
        assert wait_for(ready, timeout), what
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        finish(proc, 30)
    for pid in rank_pids(str(run_dir)).values():  # ranks in their own session, if any
        os.kill(pid, signal.SIGKILL)
    assert not os.path.exists(os.path.join(run_dir, "result.json")), "job finished before kill"


def lose_after_first_checkpoint(cmd, env, run_dir, lose, timeout, cwd=None, first=120):
    """Start a job of two ranks; once a checkpoint exists, ``lose({rank: pid})`` takes part of
    it away (a rank's process, its executor, its node) while the job must not have finished;
    then wait up to ``timeout`` s for the job to end by itself (``first``: for the checkpoint).
    (rc, out, err); the job's group is killed if it still runs."""
    import signal

    proc = start(cmd, env, cwd)
    try:
        assert wait_for(lambda: checkpoints(run_dir), first), "no checkpoint appeared"
        pids = rank_pids(str(run_dir))
        assert sorted(pids) == [0, 1], pids
        lose(pids)
        assert not os.path.exists(os.path.join(run_dir, "result.json")), (
            "the job ended before the kill"
        )
        return finish(proc, timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def kill_after_first_checkpoint(cmd, env, run_dir, timeout=120):
    """Start a job, SIGKILL all of it once a checkpoint exists; return that checkpoint's step."""
    kill_when(cmd, env, run_dir, lambda: checkpoints(run_dir), timeout)
    return checkpoints(run_dir)[0][0]
