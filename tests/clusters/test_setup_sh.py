"""scripts/setup.sh as a user without root on a machine that lacks a build tool: one install
line per system naming the package, exit 2, and nothing changed (no venv, no cache, no sudo).

The user is an unprivileged uid with no account (setpriv, a HOME of its own); PATH is a
directory of links to this machine's commands without cmake, plus a sudo and an apt-get that
record being called."""

import contextlib
import os
import pwd
import shutil
import socket
import sys
import tempfile

import pytest

from conftest import ROOT, run
from docs_pages import block

SETUP = os.path.join(ROOT, "scripts", "setup.sh")
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"


def write_project(checkout, requires):
    """A checkout's pyproject.toml and thin setup.py, as hvdtrain's: a package of no modules
    that asks for REQUIRES, with the extras scripts/setup.sh installs."""
    with open(os.path.join(checkout, "pyproject.toml"), "w") as f:
        f.write(
            "[project]\nname = 'hvdtrain'\nversion = '0'\n"
            f"dependencies = {requires!r}\n"
            "[project.optional-dependencies]\n"
            + "".join(f"{e} = []\n" for e in ("mpi", "test", "bench", "docs"))
            + "[tool.setuptools]\npy-modules = []\n"
        )
    with open(os.path.join(checkout, "setup.py"), "w") as f:
        f.write("from setuptools import setup\nsetup()\n")


def free_uid(start=41000):
    """A uid and gid that no account has: nothing to make, nothing to remove."""
    uid = start
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


def as_user(uid, cmd):
    return [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd]


def user_tempdir(prefix):
    """An unused uid and a new directory it owns (tmp_path is root's 0700); the caller removes
    it. Skips without root: becoming another uid needs it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another uid (CI and containers run as root)")
    uid = free_uid()
    d = tempfile.mkdtemp(prefix=prefix)
    os.chown(d, uid, uid)
    return uid, d


@pytest.fixture
def user_dir():
    """A directory the unprivileged user owns, removed afterwards."""
    uid, d = user_tempdir("hvdtrain-user-")
    try:
        yield uid, d
    finally:
        shutil.rmtree(d)


def path_without(d, hidden, recorders):
    """A bin directory: every command of this machine's PATH except ``hidden``, and a
    recording script for each of ``recorders``."""
    bin_dir = os.path.join(d, "bin")
    os.mkdir(bin_dir)
    for src in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if not os.path.isdir(src):
            continue
        for name in os.listdir(src):
            target = os.path.join(bin_dir, name)
            if name not in hidden and not os.path.lexists(target):
                os.symlink(os.path.join(src, name), target)
    for name in recorders:
        target = os.path.join(bin_dir, name)
        if os.path.lexists(target):
            os.unlink(target)
        with open(target, "w") as f:
            f.write(f'#!/bin/sh\necho "{name} $*" >>"{d}/called"\nexit 1\n')
        os.chmod(target, 0o755)
    return bin_dir


@pytest.mark.quick
def test_a_missing_tool_is_one_line_per_system_and_nothing_changes(user_dir):
    uid, d = user_dir
    bin_dir = path_without(d, {"cmake"}, ("sudo", "apt-get", "dnf"))
    home = os.path.join(d, "home")
    os.mkdir(home)
    os.chown(home, uid, uid)
    before = sorted(os.listdir(d))
    env = {
        "PATH": bin_dir,
        "HOME": home,
        "USER": "nobody-in-particular",
        "LANG": "C.UTF-8",
        "HVDTRAIN_VENV": os.path.join(d, "venv"),
        "HVDTRAIN_BUILD_CACHE": os.path.join(d, "cache"),
    }
    p = run(as_user(uid, ["bash", SETUP, "--wheels", os.path.join(d, "wheels")]), env, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    lines = out.splitlines()
    assert "[setup] missing: cmake 3.13+" in lines, out
    assert [l.split("#")[0].strip() for l in lines if "install" in l and "#" in l] == [
        "apt-get install cmake",
        "dnf install cmake",
    ], out
    # What the install guide shows for this case, line for line, and nothing else.
    assert (p.stdout, p.stderr) == (block("guides/install.md", "[setup] missing: ").text, "")
    # Nothing made: no venv (not even half of one), no cache, no wheel directory; no sudo,
    # no apt-get, no dnf called.
    assert sorted(os.listdir(d)) == before, out
    assert os.listdir(home) == []


def test_the_user_set_up_installs_no_test_only_system_package():
    """SLURM, munge, sshd and shellcheck are the tests' (scripts/setup_test.sh), not a user's."""
    # setup.sh's code, without its comments (which name the test set-up and shellcheck's rules)
    setup = "\n".join(l for l in open(SETUP).read().splitlines() if not l.lstrip().startswith("#"))
    test_setup = open(os.path.join(ROOT, "scripts", "setup_test.sh")).read()
    for package in ("slurmctld", "slurmd", "slurm-client", "munge", "openssh-server", "shellcheck"):
        assert package not in setup, package
        assert package in test_setup, package
    assert "sudo" not in setup


# --- the Python it sets up with --------------------------------------------------------------
# The interpreter setup.sh checks first: Debian's own where it is there (what a fresh Debian 12
# user has), else this venv's base.
SYSTEM_PYTHON = next(
    (
        p
        for p in ("/usr/bin/python3.11", "/usr/bin/python3.12", "/usr/bin/python3.13")
        if os.access(p, os.X_OK)
    ),
    getattr(sys, "_base_executable", sys.executable),
)


def saying(d, version):
    """An interpreter that answers setup.sh's questions as Python ``version`` would: this
    machine's, with a sitecustomize that sets sys.version_info and sys.version."""
    site = os.path.join(d, f"site-{version}")
    os.makedirs(site)
    major, minor, micro = map(int, version.split("."))
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(
            "import collections, sys\n"
            "sys.version_info = collections.namedtuple('version_info', 'major minor micro "
            f"releaselevel serial')({major}, {minor}, {micro}, 'final', 0)\n"
            f"sys.version = '{version} (main) [GCC]'\n"
        )
    path = os.path.join(d, f"python{major}.{minor}")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{SYSTEM_PYTHON}" "$@"\n')
    os.chmod(path, 0o755)
    return path


def setup_env(d, **extra):
    return {
        "PATH": os.environ["PATH"],
        "HOME": d,
        "LANG": "C.UTF-8",
        "HVDTRAIN_SKIP_APT": "1",
        "HVDTRAIN_BUILD_CACHE": "0",
        "HVDTRAIN_VENV": os.path.join(d, "venv"),
        **extra,
    }


@pytest.mark.quick
@pytest.mark.parametrize("version", ["3.10.12", "3.14.0"])
def test_a_python_outside_the_range_is_one_line_before_anything_changes(tmp_path, version):
    """3.10 (Keras 3.15 and NumPy 2.4 need 3.11) and 3.14 (no TensorFlow 2.21 wheel): refused
    in one line naming the version and the range, before a venv or anything else is made."""
    python = saying(str(tmp_path), version)
    before = sorted(os.listdir(tmp_path))
    p = run(["bash", SETUP], setup_env(str(tmp_path), PYTHON=python), timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout == "" and p.stderr.splitlines() == [
        f"[setup] error: PYTHON={python} is Python {version}; hvdtrain's locked stack needs "
        "3.11-3.13 (TensorFlow 2.21, Keras 3.15, NumPy 2.4)"
    ]
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.quick
def test_python_of_another_minor_than_the_venv_is_refused(tmp_path):
    """PYTHON names a new venv's interpreter; a venv already there keeps its own, so asking
    for another minor version is one line (remove the venv, or unset PYTHON), not silence."""
    d = str(tmp_path)
    venv = os.path.join(d, "venv")
    assert (
        run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", venv], os.environ, timeout=60).returncode
        == 0
    )
    have = run(
        [
            os.path.join(venv, "bin", "python"),
            "-c",
            "import platform; print(platform.python_version())",
        ],
        os.environ,
        timeout=30,
    ).stdout.strip()
    other = "3.13.5" if not have.startswith("3.13.") else "3.12.3"
    python = saying(d, other)
    before = sorted(os.listdir(venv))
    p = run(["bash", SETUP], setup_env(d, PYTHON=python), timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.splitlines() == [
        f"[setup] error: PYTHON={python} is Python {other}, but {venv} holds Python {have}: "
        f"remove {venv} for a new one, or unset PYTHON"
    ]
    assert sorted(os.listdir(venv)) == before


def probe_wheel(path, requires_python):
    """A wheel of ``lockprobe`` 1.0 whose metadata needs ``requires_python``."""
    import zipfile

    meta = (
        f"Metadata-Version: 2.1\nName: lockprobe\nVersion: 1.0\n"
        f"Requires-Python: {requires_python}\n"
    )
    files = {
        "lockprobe/__init__.py": "",
        "lockprobe-1.0.dist-info/METADATA": meta,
        "lockprobe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files["lockprobe-1.0.dist-info/RECORD"] = (
        "".join(f"{n},,\n" for n in files) + "lockprobe-1.0.dist-info/RECORD,,\n"
    )
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


@contextlib.contextmanager
def lockprobe_index(root, write_wheel, requires_python):
    """A package index on loopback (PEP 503, with Requires-Python as PyPI gives it) in
    ``root``, holding lockprobe 1.0 (its wheel written by ``write_wheel(path)``) that needs
    ``requires_python``; its URL while the block runs."""
    import functools
    import html
    import http.server
    import threading

    (root / "simple" / "lockprobe").mkdir(parents=True)
    (root / "files").mkdir()
    write_wheel(root / "files" / "lockprobe-1.0-py3-none-any.whl")
    (root / "simple" / "lockprobe" / "index.html").write_text(
        '<html><body><a href="../../files/lockprobe-1.0-py3-none-any.whl" '
        f'data-requires-python="{html.escape(requires_python)}">lockprobe-1.0-py3-none-any.whl'
        "</a></body></html>\n"
    )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def loopback_index(tmp_path):
    """lockprobe 1.0, which needs Python >= 3.99, on an index on loopback; its URL."""
    with lockprobe_index(
        tmp_path / "index", lambda path: probe_wheel(path, ">=3.99"), ">=3.99"
    ) as url:
        yield url


@pytest.fixture
def probe_checkout(tmp_path):
    """(a checkout whose pyproject.toml asks for lockprobe, pinned in its constraints.txt to 1.0,
    its venv, the venv's site-packages): made with this machine's Python, holding what
    setup.sh's first pip call asks for (pip, setuptools, wheel, packaging), so that nothing
    but lockprobe is looked for on an index."""
    d = str(tmp_path)
    checkout = os.path.join(d, "checkout")
    os.makedirs(os.path.join(checkout, "scripts"))
    shutil.copy(SETUP, os.path.join(checkout, "scripts"))
    write_project(checkout, ["lockprobe"])
    with open(os.path.join(checkout, "constraints.txt"), "w") as f:
        f.write("# the lock\nlockprobe==1.0\n")
    venv = os.path.join(d, "venv")
    assert run([SYSTEM_PYTHON, "-m", "venv", venv], os.environ, timeout=120).returncode == 0
    site = run(
        [
            os.path.join(venv, "bin", "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        os.environ,
        timeout=30,
    ).stdout.strip()
    import importlib
    import importlib.metadata

    for name in ("wheel", "packaging"):  # this venv's, linked
        package = os.path.dirname(importlib.import_module(name).__file__)
        info = str(importlib.metadata.distribution(name)._path)
        for path in (package, info):
            os.symlink(path, os.path.join(site, os.path.basename(path)))
    return checkout, venv, site


def set_up_against(checkout, index):
    """setup.sh of ``checkout`` with pip's index ``index`` and no pip configuration:
    (exit status, output, its [setup] error: lines)."""
    d = os.path.dirname(checkout)
    env = setup_env(
        d,
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=index,
        PIP_RETRIES="1",
        PIP_NO_BUILD_ISOLATION="0",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    p = run(["bash", os.path.join(checkout, "scripts", "setup.sh")], env, timeout=300)
    out = p.stdout + p.stderr
    assert "ResolutionImpossible" not in out and "Traceback" not in out, out
    return p.returncode, out, [l for l in out.splitlines() if l.startswith("[setup] error:")]


def test_a_pin_this_python_cannot_install_is_one_line_naming_it(probe_checkout, loopback_index):
    """What pip refuses is said in one line: the pin, and the Python it needs (a lock pin
    that needs a newer micro release than Debian 12's 3.11.2 was pip's bare
    ResolutionImpossible). lockprobe 1.0 needs Python >= 3.99 on an index on loopback."""
    checkout, venv, site = probe_checkout
    status, out, errors = set_up_against(checkout, loopback_index)
    assert status == 1, out
    version = run(
        [
            os.path.join(venv, "bin", "python"),
            "-c",
            "import platform; print(platform.python_version())",
        ],
        os.environ,
        timeout=30,
    ).stdout.strip()
    log = os.path.join(venv, ".hvdtrain-pip.log")
    assert errors == [
        f"[setup] error: constraints.txt cannot install on Python {version} "
        f"({venv}/bin/python): lockprobe==1.0 needs Python >=3.99 "
        f"(pip's output: {log})"
    ], out
    assert "lockprobe" in open(log).read()  # pip's own words kept
    # Nothing was installed, and the next run tries again (no stamp written).
    assert not os.path.exists(os.path.join(venv, ".hvdtrain-deps"))
    assert not [n for n in os.listdir(site) if n.startswith("lockprobe")]


def test_an_index_out_of_reach_is_named_as_such(probe_checkout):
    """No index reached (a proxy, a certificate, a network down) is said as that, not as "no
    matching distribution" for the first package pip asked for."""
    checkout, venv, _ = probe_checkout
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status, out, errors = set_up_against(checkout, f"http://127.0.0.1:{port}/simple/")
    assert status == 1, out
    assert len(errors) == 1 and errors[0].startswith(
        "[setup] error: pip could not reach the package index: "
    ), out
    assert "Connection refused" in errors[0] and "/simple/" in errors[0], errors
