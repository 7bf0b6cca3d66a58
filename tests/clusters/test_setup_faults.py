"""scripts/setup.sh under faults, as a user without root: a set-up killed or Ctrl-C'd while pip
writes a package or while the venv is made, two set-ups of one venv at once, and a shared
build cache whose entries are damaged, changed or open to others. Each ends in a working venv,
or in one ``[setup] error:`` line naming the problem and the command that fixes it, with
nothing the user had lost.

The venvs are real (this machine's Python and its ensurepip), made and set up by an
unprivileged uid with no account (setpriv); pip installs from a package index on loopback
that holds one project, ``lockprobe`` (thousands of small files: its install takes long enough
to be interrupted midway). The locked stack (TensorFlow, Keras, Horovod) is this venv's,
reached through a .pth file (links into its site-packages), so that setup.sh's check of
Horovod passes without a compile; the checkout is setup.sh, its patches, and a pyproject.toml
that asks for lockprobe. The build cache's entries are copies of the entry this venv's Horovod was
installed from (found by its wheel's RECORD), owned by root: to the user, a teammate's."""

import glob
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sysconfig
import zipfile

import pytest
from test_setup_sh import SYSTEM_PYTHON, as_user, free_uid, lockprobe_index, write_project

from conftest import ROOT, run, running, wait_for

SETUP = os.path.join(ROOT, "scripts", "setup.sh")
SITE = sysconfig.get_paths()["purelib"]
FILES = 4000  # lockprobe's modules: about 2 s of pip's writing on this machine
pytestmark = pytest.mark.timeout(600)


def lockprobe_wheel(path):
    """lockprobe 1.0: FILES modules of 2 KB each."""
    files = {f"lockprobe/m{i:04d}.py": f"# {i}\n" + "x = 1\n" * 340 for i in range(FILES)}
    files["lockprobe/__init__.py"] = "VERSION = '1.0'\n"
    files["lockprobe-1.0.dist-info/METADATA"] = (
        "Metadata-Version: 2.1\nName: lockprobe\nVersion: 1.0\nRequires-Python: >=3\n"
    )
    files["lockprobe-1.0.dist-info/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = "".join(f"{n},,\n" for n in files) + "lockprobe-1.0.dist-info/RECORD,,\n"
    files["lockprobe-1.0.dist-info/RECORD"] = record
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A PEP 503 index on loopback with lockprobe 1.0; its URL."""
    with lockprobe_index(tmp_path_factory.mktemp("index"), lockprobe_wheel, ">=3") as url:
        yield url


@pytest.fixture(scope="module")
def user():
    """(uid, a directory it owns holding ``stack``: links to this venv's site-packages without
    hvdtrain and what the user's venv brings itself); removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another uid (CI and containers run as root)")
    import tempfile

    uid = free_uid(42000)
    d = tempfile.mkdtemp(prefix="hvdtrain-setup-faults-")
    os.chown(d, uid, uid)
    stack = os.path.join(d, "stack")
    os.mkdir(stack)
    for name in os.listdir(SITE):
        if not re.match(
            r"(hvdtrain|__editable__|_hvdtrain|.*\.pth$|pip\b|pip-|setuptools|"
            r"_distutils_hack|distutils-precedence|pkg_resources|lockprobe)",
            name,
            re.I,
        ):
            os.symlink(os.path.join(SITE, name), os.path.join(stack, name))
    try:
        yield uid, d
    finally:
        shutil.rmtree(d)


def new_checkout(user, name):
    """A checkout of setup.sh and its patches whose pyproject.toml asks for lockprobe (pinned to
    1.0 in its lock), owned by the user; (checkout, the venv it would make)."""
    uid, d = user
    base = os.path.join(d, name)
    checkout = os.path.join(base, "checkout")
    os.makedirs(os.path.join(checkout, "scripts"))
    shutil.copy(SETUP, os.path.join(checkout, "scripts"))
    shutil.copytree(
        os.path.join(ROOT, "scripts", "patches"), os.path.join(checkout, "scripts", "patches")
    )
    write_project(checkout, ["lockprobe"])
    with open(os.path.join(checkout, "constraints.txt"), "w") as f:
        f.write("lockprobe==1.0\n")
    with open(os.path.join(checkout, "README.md"), "w") as f:
        f.write("# hvdtrain\n")
    os.mkdir(os.path.join(checkout, "hvdtrain"))
    os.makedirs(os.path.join(base, "home"))
    for top, dirs, files in os.walk(base):
        for n in [top] + [os.path.join(top, x) for x in dirs + files]:
            os.lchown(n, uid, uid)
    return checkout, os.path.join(base, "venv")


def user_env(user, checkout, index, **extra):
    uid, d = user
    base = os.path.dirname(checkout)
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.path.join(base, "home"),
        "LANG": "C.UTF-8",
        "TMPDIR": base,
        "HVDTRAIN_SKIP_APT": "1",
        "HVDTRAIN_VENV": os.path.join(base, "venv"),
        "HVDTRAIN_BUILD_CACHE": "0",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": index,
        "PIP_RETRIES": "0",
        "PIP_NO_BUILD_ISOLATION": "0",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        **extra,
    }


def make_venv(user, venv, env):
    """The venv, made as setup.sh would, with the stack reachable: wheel and packaging (what
    setup.sh's first pip call asks for) and a .pth naming the stack's links and this checkout
    (for ``import hvdtrain``). Its site-packages."""
    uid, d = user
    p = run(as_user(uid, [SYSTEM_PYTHON, "-m", "venv", venv]), env, timeout=120)
    assert p.returncode == 0, p.stderr
    return add_stack(user, venv, env)


def add_stack(user, venv, env):
    uid, d = user
    site = run(
        as_user(
            uid,
            [
                f"{venv}/bin/python",
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
        ),
        env,
        timeout=60,
    ).stdout.strip()
    with open(os.path.join(site, "stack.pth"), "w") as f:
        f.write(f"{d}/stack\n{ROOT}\n")
    os.chown(os.path.join(site, "stack.pth"), uid, uid)
    return site


def set_up(user, checkout, env, *args, timeout=300):
    uid, _ = user
    p = run(
        as_user(uid, ["bash", os.path.join(checkout, "scripts", "setup.sh"), *args]),
        env,
        timeout=timeout,
    )
    out = p.stdout + p.stderr
    assert "Traceback" not in out and "ResolutionImpossible" not in out, out
    return p.returncode, out


def start(user, checkout, env, *args):
    uid, _ = user
    return subprocess.Popen(
        as_user(uid, ["bash", os.path.join(checkout, "scripts", "setup.sh"), *args]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def whole(site):
    """lockprobe is installed whole: every module of its wheel, and what pip writes last."""
    pkg = os.path.join(site, "lockprobe")
    return (
        os.path.exists(os.path.join(site, "lockprobe-1.0.dist-info", "INSTALLER"))
        and len(glob.glob(os.path.join(pkg, "*.py"))) == FILES + 1
        and all(
            os.path.getsize(os.path.join(pkg, f"m{i:04d}.py")) == len(f"# {i}\n") + 6 * 340
            for i in range(FILES)
        )
    )


def ready(out):
    return re.search(
        r"^\[setup\] ready: tensorflow 2\.21\.0 horovod 0\.28\.1\+hvdtrain\.\d+$", out, re.M
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_an_install_interrupted_midway_is_finished_by_the_next_run(user, index, sig):
    """Interrupted while pip finishes lockprobe's install (its files and metadata written, its
    modules being byte-compiled, its INSTALLER and installed RECORD not yet written: pip alone
    would take the package as installed and never finish it), the next run reinstalls it
    whole, and the venv is ready."""
    checkout, venv = new_checkout(user, f"interrupted-{sig.name}")
    env = user_env(user, checkout, index)
    site = make_venv(user, venv, env)
    info = os.path.join(site, "lockprobe-1.0.dist-info")
    proc = start(user, checkout, env)
    try:
        midway = wait_for(
            lambda: (
                proc.poll() is not None
                or (
                    os.path.exists(os.path.join(info, "METADATA"))
                    and not os.path.exists(os.path.join(info, "INSTALLER"))
                )
            ),
            120,
            0.001,
        )
        os.killpg(proc.pid, sig)
    finally:
        out = proc.communicate(timeout=60)[0]
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # What the interrupt left: the metadata pip trusts, without what pip writes last.
    assert midway and proc.returncode != 0, out
    assert os.path.exists(os.path.join(info, "METADATA")), out
    assert not os.path.exists(os.path.join(info, "INSTALLER")), out
    status, out = set_up(user, checkout, env)
    assert status == 0, out
    assert (
        "[setup] an interrupted install left lockprobe-1.0.dist-info unfinished: "
        "installing it again"
    ) in out.splitlines(), out
    assert whole(site) and ready(out), out
    assert not os.path.exists(os.path.join(venv, ".hvdtrain-installing"))
    # The run after that only verifies.
    status, again = set_up(user, checkout, env)
    assert status == 0 and "installing" not in again and ready(again), again


@pytest.mark.parametrize("case", ["killed in ensurepip", "made without pip"])
def test_a_venv_left_without_pip_is_mended(user, index, case):
    """A set-up killed while the venv gets its pip leaves a venv without pip: the next run
    makes it again (its marker says the directory is setup.sh's); a venv made without pip by
    other means gets pip from ensurepip, its files kept. Then the set-up goes on to pip: here
    to its one-line refusal, as this index has none of the build's tools."""
    checkout, venv = new_checkout(user, case.replace(" ", "-"))
    env = user_env(user, checkout, index, PYTHON=SYSTEM_PYTHON)
    uid, _ = user
    if case == "killed in ensurepip":
        proc = start(user, checkout, env)
        try:
            inside = wait_for(
                lambda: glob.glob(f"{venv}/lib/python3*/site-packages/pip/*"), 120, 0.002
            )
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            out = proc.communicate(timeout=60)[0]
        assert inside, out
        assert os.path.exists(os.path.join(venv, ".hvdtrain-venv-incomplete")), out
        said = f"[setup] {venv} was left half-made by an interrupted set-up: making it again"
    else:
        p = run(as_user(uid, [SYSTEM_PYTHON, "-m", "venv", "--without-pip", venv]), env)
        assert p.returncode == 0, p.stderr
        with open(os.path.join(venv, "notes.txt"), "w") as f:
            f.write("mine\n")
        said = f"[setup] {venv} has no working pip: installing it with ensurepip"
    status, out = set_up(user, checkout, env)
    assert status == 1, out
    lines = out.splitlines()
    assert said in lines, out
    assert [l for l in lines if l.startswith("[setup] error:")] == [
        "[setup] error: pip install -c constraints.txt failed: No matching distribution "
        f"found for wheel (pip's output: {venv}/.hvdtrain-pip.log)"
    ], out
    assert run([f"{venv}/bin/python", "-m", "pip", "--version"], env).returncode == 0
    assert not os.path.exists(os.path.join(venv, ".hvdtrain-venv-incomplete"))
    if case == "made without pip":
        assert open(os.path.join(venv, "notes.txt")).read() == "mine\n"


def test_a_directory_of_other_files_is_not_made_a_venv(user, index):
    """HVDTRAIN_VENV naming a directory that holds other files (a typo, $HOME) is refused in
    one line, and nothing in it changes."""
    checkout, venv = new_checkout(user, "not-a-venv")
    uid, _ = user
    os.mkdir(venv)
    with open(os.path.join(venv, "thesis.tex"), "w") as f:
        f.write("mine\n")
    os.chown(venv, uid, uid)
    status, out = set_up(user, checkout, user_env(user, checkout, index, PYTHON=SYSTEM_PYTHON))
    assert status == 1, out
    assert out.splitlines() == [
        f"[setup] error: {venv} holds files but no virtual environment (no bin/python): "
        "set HVDTRAIN_VENV to a new or empty directory"
    ], out
    assert os.listdir(venv) == ["thesis.tex"]


def test_two_set_ups_of_one_venv_run_one_after_the_other(user, index):
    """Two set-ups of one venv started half a second apart: the second waits for the first
    (a lock on the venv), then finds the stack installed; both end ready."""
    checkout, venv = new_checkout(user, "twice")
    env = user_env(user, checkout, index)
    site = make_venv(user, venv, env)
    first = start(user, checkout, env)
    wait_for(lambda: os.path.exists(os.path.join(venv, ".hvdtrain-installing")), 60, 0.01)
    second = start(user, checkout, env)
    outs = []
    for proc in (first, second):
        try:
            outs.append(proc.communicate(timeout=300)[0])
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert first.returncode == 0 and second.returncode == 0, outs
    assert (
        f"[setup] another set-up of {venv} is running: waiting for it to end"
        in outs[1].splitlines()
    ), outs
    assert "installing the locked Python stack" in outs[0], outs
    assert "installing the locked Python stack" not in outs[1], outs
    assert all(ready(o) for o in outs) and whole(site), outs


# --- the build cache -----------------------------------------------------------------------
def installed_entry():
    """The build cache's entry this venv's Horovod was installed from: the one whose wheel
    holds the installed build record (the op library's sha256, TensorFlow's version)."""
    from importlib import metadata

    dist = metadata.distribution("horovod")
    record = dist.locate_file("horovod/hvdtrain_built.json").read_bytes()
    cache = os.environ.get("HVDTRAIN_BUILD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvdtrain"
    )
    for entry in sorted(glob.glob(os.path.join(cache, "horovod-0.28.1-*"))):
        for whl in glob.glob(os.path.join(entry, "horovod-*.whl")):
            with zipfile.ZipFile(whl) as z:
                if z.read("horovod/hvdtrain_built.json") == record:
                    return entry
    pytest.fail(
        f"no entry of the build cache {cache} holds this venv's horovod "
        f"{dist.version}: run scripts/setup.sh"
    )


@pytest.fixture(scope="module")
def cache_checkout(user, index):
    """A checkout whose venv is set up (ready), for runs of setup.sh --wheels against caches."""
    checkout, venv = new_checkout(user, "cache")
    env = user_env(user, checkout, index)
    make_venv(user, venv, env)
    status, out = set_up(user, checkout, env)
    assert status == 0 and ready(out), out
    return checkout, venv, env


def team_cache(user, name, entry):
    """A copy of ``entry`` in a cache directory owned by root (0755): a teammate's cache this
    user reads and cannot write. (cache, the entry's copy)."""
    _, d = user
    cache = os.path.join(d, name)
    os.mkdir(cache)
    copy = os.path.join(cache, os.path.basename(entry))
    shutil.copytree(entry, copy)
    for top, dirs, files in os.walk(cache):
        os.chmod(top, 0o755)
        for f in files:
            os.chmod(os.path.join(top, f), 0o644)
    return cache, copy


def listing(d):
    return sorted(
        (os.path.relpath(os.path.join(t, f), d), os.path.getsize(os.path.join(t, f)))
        for t, _, fs in os.walk(d)
        for f in fs
    )


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_a_read_only_team_cache_is_used_and_wheels_replace_only_their_own_files(
    user, cache_checkout
):
    """A teammate's cache this user cannot write, holding this build: its wheel is used and
    nothing is written there. The build folder a killed set-up of this host left is swept. --wheels DIR where DIR holds other builds' wheels and a file of
    the user's: only the files of the same names are replaced, each said, the others stay, and
    the install command names the two wheels (DIR/*.whl would take the others too)."""
    checkout, venv, env = cache_checkout
    uid, d = user
    cache, entry = team_cache(user, "team-cache", installed_entry())
    before = listing(cache)
    wheels = os.path.join(d, "wheels")
    os.mkdir(wheels)
    whl = os.path.basename(glob.glob(os.path.join(entry, "horovod-*.whl"))[0])
    others = {
        "horovod-0.28.1+hvdtrain.1-cp312-cp312-linux_x86_64.whl": b"a cp312 build",
        "horovod-0.28.1+hvdtrain.1.gpu-cp311-cp311-linux_x86_64.whl": b"the GPU build",
        "hvdtrain-0.0.1-py3-none-any.whl": b"an older hvdtrain",
        "notes.txt": b"mine",
        whl: b"an older copy of this build",
    }
    for name, data in others.items():
        with open(os.path.join(wheels, name), "wb") as f:
            f.write(data)
    for n in [wheels] + [os.path.join(wheels, x) for x in os.listdir(wheels)]:
        os.chown(n, uid, uid)
    # Build folders in the user's own cache (where a build of this user would go: the team's
    # is not writable): a killed set-up's of this host, a running one's, another host's.
    builds = os.path.join(env["HOME"], ".cache", "hvdtrain", ".builds")
    host = socket.gethostname()
    dead = next(pid for pid in range(4194000, 4194300) if not running(pid))
    folders = {
        f"hvdtrain-build-{host}-{dead}-Ab12Cd": False,
        f"hvdtrain-build-{host}-{os.getpid()}-Ef34Gh": True,
        f"hvdtrain-build-elsewhere-{dead}-Ij56Kl": True,
    }
    for name in folders:
        os.makedirs(os.path.join(builds, name, "horovod-0.28.1"))
    for top, dirs, _ in os.walk(os.path.join(env["HOME"], ".cache")):
        for n in [top] + [os.path.join(top, x) for x in dirs]:
            os.chown(n, uid, uid)
    status, out = set_up(user, checkout, dict(env, HVDTRAIN_BUILD_CACHE=cache), "--wheels", wheels)
    assert status == 0, out
    assert listing(cache) == before  # read, not written
    assert {n: n in os.listdir(builds) for n in folders} == folders  # the killed one's swept
    assert sha256(os.path.join(wheels, whl)) == sha256(os.path.join(entry, whl))
    for name, data in others.items():
        if name != whl:
            assert open(os.path.join(wheels, name), "rb").read() == data, name
    lines = out.splitlines()
    assert f"[setup] replacing {wheels}/{whl}" in lines, out
    mine = [n for n in os.listdir(wheels) if n.startswith("hvdtrain-0-")]
    assert len(mine) == 1, os.listdir(wheels)
    assert (
        f"[setup] elsewhere: pip install -c {wheels}/constraints.txt {wheels}/{whl} "
        f"{wheels}/{mine[0]} (or --no-deps into an env with TensorFlow 2.21.0)"
    ) in lines, out
    assert not [l for l in lines if "compiling" in l], out


@pytest.mark.parametrize(
    "fault", ["bytes changed", "truncated", "group-writable", "no SHA256SUMS", "a third user's"]
)
def test_a_bad_entry_of_a_teammates_cache_is_one_line_and_not_installed(
    user, cache_checkout, fault
):
    """An entry of another user's cache whose wheel changed (a flipped byte, a truncation: its
    sha256 is not the one recorded beside it), that others than its owner can write (a cache
    shared by group write: anyone could plant code every import runs), that has no recorded
    sha256, or that a third user added to a cache anyone may write: not installed; one line
    naming it, its owner and the command that removes it."""
    checkout, venv, env = cache_checkout
    uid, d = user
    cache, entry = team_cache(user, "cache-" + fault.replace(" ", "-"), installed_entry())
    whl = glob.glob(os.path.join(entry, "horovod-*.whl"))[0]
    if fault == "bytes changed":
        with open(whl, "r+b") as f:
            f.seek(os.path.getsize(whl) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        why = "does not match its SHA256SUMS (changed or damaged)"
    elif fault == "truncated":
        os.truncate(whl, os.path.getsize(whl) // 3)
        why = "does not match its SHA256SUMS (changed or damaged)"
    elif fault == "group-writable":
        os.chmod(whl, 0o664)
        why = f"has {os.path.basename(whl)} writable by others than its owner (mode -rw-rw-r--)"
    elif fault == "no SHA256SUMS":
        os.unlink(os.path.join(entry, "SHA256SUMS"))
        why = "has no SHA256SUMS (made by an older scripts/setup.sh)"
    else:  # a cache anyone may add to, and an entry someone else added
        os.chmod(cache, 0o1777)
        third = free_uid(uid + 1)
        for top, dirs, files in os.walk(entry):
            for n in [top] + [os.path.join(top, x) for x in files]:
                os.chown(n, third, third)
        why = f"is owned by uid {third}, neither this user nor the cache's owner (uid 0)"
    owner = os.stat(entry).st_uid
    wheels = os.path.join(d, "wheels-" + fault.replace(" ", "-"))
    status, out = set_up(user, checkout, dict(env, HVDTRAIN_BUILD_CACHE=cache), "--wheels", wheels)
    assert status == 1, out
    assert [l for l in out.splitlines() if l.startswith("[setup] error")] == [
        f"[setup] error: the build cache's {entry} {why}: not installed; its owner (uid {owner}) "
        f"removes it (rm -rf {entry}), or set HVDTRAIN_BUILD_CACHE=0 to build without the "
        "cache"
    ], out
    assert not glob.glob(os.path.join(wheels, "horovod-*.whl"))


def bare_venv(user, venv, env):
    """A venv with what setup.sh's first pip call asks for (wheel, packaging) and without the
    stack: Horovod is to be built."""
    uid, _ = user
    assert run(as_user(uid, [SYSTEM_PYTHON, "-m", "venv", venv]), env, timeout=120).returncode == 0
    site = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))[0]
    import importlib.metadata

    for name in ("wheel", "packaging"):
        dist = importlib.metadata.distribution(name)
        for path in (os.path.dirname(dist.locate_file(f"{name}/__init__.py")), str(dist._path)):
            os.symlink(path, os.path.join(site, os.path.basename(path)))
    return site


def test_a_failed_compile_is_one_line_and_leaves_no_build_folder(user, index):
    """The compile's first error (here: the sdist is not on the index), in one line with the
    log's path; pip's and the compiler's output only in that log; the build folder removed."""
    checkout, venv = new_checkout(user, "failed-build")
    env = user_env(user, checkout, index)
    bare_venv(user, venv, env)
    status, out = set_up(user, checkout, env)
    assert status == 1, out
    log = os.path.join(venv, ".hvdtrain-build.log")
    assert [l for l in out.splitlines() if not l.startswith("[setup] ") or "error" in l] == [
        "[setup] error: compiling horovod failed: ERROR: Could not find a version that "
        "satisfies the requirement horovod==0.28.1 (from versions: none) (the whole output: "
        f"{log})"
    ], out
    assert "horovod==0.28.1" in open(log).read()
    base = os.path.dirname(checkout)  # TMPDIR: the build folder's place without a cache
    assert not glob.glob(os.path.join(base, "hvdtrain-build-*")), os.listdir(base)


def test_a_path_with_whitespace_is_refused_before_the_compile(user, index):
    """Horovod's build cannot compile in a path with a space (it ended after minutes in a
    linker error naming half the path): refused in one line before the compile starts, once
    the stack is installed (a cached build installs on such a path)."""
    checkout, _ = new_checkout(user, "with space")
    venv = os.path.join(os.path.dirname(checkout), "my venv")
    env = user_env(user, checkout, index, HVDTRAIN_VENV=venv)
    bare_venv(user, venv, env)
    status, out = set_up(user, checkout, env)
    assert status == 1, out
    lines = out.splitlines()
    assert [l for l in lines if l.startswith("[setup] error:")] == [
        "[setup] error: Horovod's build cannot compile in a path with whitespace: "
        f"{os.path.dirname(os.path.dirname(checkout))}/with space/checkout (move it, or set "
        "HVDTRAIN_VENV / HVDTRAIN_BUILD_CACHE / TMPDIR elsewhere; a cached build installs on "
        "any path)"
    ], out
    assert not [l for l in lines if "compiling" in l], out


def test_a_changed_horovod_file_is_installed_again_from_the_checked_cache(user, index):
    """A byte of the venv's Horovod library changed after the install (a valid wheel with a
    changed library went through set-up, check-build and training before): setup.sh's check
    compares every installed file with pip's RECORD, and installs the wheel again from a
    cache entry whose sha256 it checked; the venv is ready and its library is the wheel's."""
    checkout, venv = new_checkout(user, "changed-library")
    uid, d = user
    env = user_env(user, checkout, index)
    cache, entry = team_cache(user, "cache-for-changed", installed_entry())
    # The venv's stack: links, but Horovod copied into the venv itself, as pip installed it
    # there (its library is to be changed).
    stack = os.path.join(os.path.dirname(checkout), "stack")
    os.mkdir(stack)
    site = make_venv(user, venv, env)
    for name in os.listdir(os.path.join(d, "stack")):
        src = os.path.join(SITE, name)
        if re.match(r"horovod\b|horovod-", name):
            shutil.copytree(src, os.path.join(site, name))
        else:
            os.symlink(src, os.path.join(stack, name))
    for top, dirs, files in os.walk(site):
        for n in [top] + [os.path.join(top, x) for x in dirs + files]:
            os.lchown(n, uid, uid)
    with open(os.path.join(site, "stack.pth"), "w") as f:
        f.write(f"{stack}\n{ROOT}\n")
    (lib,) = glob.glob(os.path.join(site, "horovod", "tensorflow", "mpi_lib*.so"))
    with open(lib, "r+b") as f:
        f.seek(os.path.getsize(lib) - 100)  # past the code: the library still loads
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    status, out = set_up(user, checkout, dict(env, HVDTRAIN_BUILD_CACHE=cache))
    assert status == 0 and ready(out), out
    assert (
        f"[setup] installing horovod 0.28.1+hvdtrain.1 from the build cache ({entry}: built "
        "from the same sdist, patches, Python, TensorFlow, MPI and settings)"
    ) in out.splitlines(), out
    (installed,) = glob.glob(os.path.join(site, "horovod", "tensorflow", "mpi_lib*.so"))
    with zipfile.ZipFile(glob.glob(os.path.join(entry, "horovod-*.whl"))[0]) as z:
        assert hashlib.sha256(z.read(os.path.relpath(installed, site))).hexdigest() == sha256(
            installed
        )
    assert not [l for l in out.splitlines() if "compiling" in l], out
