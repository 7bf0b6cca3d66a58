"""scripts/setup.sh as a user without root on a machine that lacks a build tool: one install
line per system naming the package, exit 2, and nothing changed (no venv, no cache, no sudo).

The user is an unprivileged uid with no account (setpriv, a HOME of its own); PATH is a
directory of links to this machine's commands without cmake, plus a sudo and an apt-get that
record being called."""
import os
import pwd
import shutil
import tempfile

import pytest

from conftest import ROOT, run
from docs_pages import block

SETUP = os.path.join(ROOT, "scripts", "setup.sh")
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"


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
    env = {"PATH": bin_dir, "HOME": home, "USER": "nobody-in-particular", "LANG": "C.UTF-8",
           "HVDTRAIN_VENV": os.path.join(d, "venv"),
           "HVDTRAIN_BUILD_CACHE": os.path.join(d, "cache")}
    p = run(as_user(uid, ["bash", SETUP, "--wheels", os.path.join(d, "wheels")]), env,
            timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    lines = out.splitlines()
    assert "[setup] missing: cmake 3.13+" in lines, out
    assert [l.split("#")[0].strip() for l in lines if "install" in l and "#" in l] == [
        "apt-get install cmake", "dnf install cmake"], out
    # What the install guide shows for this case, line for line, and nothing else.
    assert (p.stdout, p.stderr) == (block("guides/install.md", "[setup] missing: ").text, "")
    # Nothing made: no venv (not even half of one), no cache, no wheel directory; no sudo,
    # no apt-get, no dnf called.
    assert sorted(os.listdir(d)) == before, out
    assert os.listdir(home) == []


def test_the_user_set_up_installs_no_test_only_system_package():
    """SLURM, munge, sshd and shellcheck are the tests' (scripts/setup_test.sh), not a user's."""
    # setup.sh's code, without its comments (which name the test set-up and shellcheck's rules)
    setup = "\n".join(l for l in open(SETUP).read().splitlines()
                      if not l.lstrip().startswith("#"))
    test_setup = open(os.path.join(ROOT, "scripts", "setup_test.sh")).read()
    for package in ("slurmctld", "slurmd", "slurm-client", "munge", "openssh-server",
                    "shellcheck"):
        assert package not in setup, package
        assert package in test_setup, package
    assert "sudo" not in setup
