"""glibc's huge-page tunable (hvdtrain/base/malloc.py): the decision, the launch scripts' copy
of it (scripts/hugetlb.sh) agreeing with it, and a launched rank's re-exec in one real
process (the launcher's size variable set by hand: no launcher needed to start it)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env
from hvdtrain.base import malloc

pytestmark = pytest.mark.quick
HUGE = "glibc.malloc.hugetlb=1"
NEW, OLD, NONE = ((2, 36), "madvise"), ((2, 34), "madvise"), (None, "madvise")


@pytest.mark.parametrize(
    "environ,machine,want",
    [
        ({}, NEW, HUGE),
        ({}, ((2, 35), "always"), HUGE),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, NEW, "glibc.malloc.arena_max=2:" + HUGE),
        ({"GLIBC_TUNABLES": ""}, NEW, HUGE),
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, NEW, None),  # the user's choice
        ({"GLIBC_TUNABLES": "a.b=1:glibc.malloc.hugetlb=2"}, NEW, None),
        ({"HVDTRAIN_HUGETLB": "0"}, NEW, None),  # the off switch
        ({"HVDTRAIN_HUGETLB": "1"}, NEW, HUGE),
        ({}, OLD, None),
        ({}, NONE, None),  # no such tunable
        ({}, ((2, 36), "never"), None),
        ({}, ((2, 36), None), None),  # no THP
    ],
)
def test_the_decision(environ, machine, want):
    assert malloc.tunables(environ, machine) == want


def shell_decides(env):
    """GLIBC_TUNABLES after scripts/hugetlb.sh's hvdtrain_hugetlb in ``env`` (None: unset)."""
    p = subprocess.run(
        [
            "bash",
            "-c",
            f"source {ROOT}/scripts/hugetlb.sh; hvdtrain_hugetlb; "
            'printf "%s" "${GLIBC_TUNABLES-<unset>}"',
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0 and p.stderr == "", p.stderr
    return None if p.stdout == "<unset>" else p.stdout


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
        {"GLIBC_TUNABLES": ""},
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"},
        {"HVDTRAIN_HUGETLB": "0"},
        {"HVDTRAIN_HUGETLB": "1"},
    ],
    ids=repr,
)
def test_the_launch_scripts_decide_as_hvdtrain(extra, tmp_path):
    """On this machine (glibc and THP as they are), the shell's GLIBC_TUNABLES is the one
    base/malloc.py gives a rank of the same environment (or the environment's own)."""
    env = clean_env(tmp_path / "home", **extra)
    want = malloc.tunables(env)
    assert shell_decides(env) == (want if want is not None else env.get("GLIBC_TUNABLES"))


def test_the_launch_scripts_skip_an_old_glibc(tmp_path):
    """glibc 2.34 (a getconf that says so, first on PATH): no tunable, as tunables(OLD)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "getconf").write_text("#!/bin/sh\necho 'glibc 2.34'\n")
    (fake / "getconf").chmod(0o755)
    env = clean_env(tmp_path / "home")
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    assert shell_decides(env) is None and malloc.tunables({}, OLD) is None


# A program that says when it starts (before hvdtrain) and what it has once hvdtrain is imported.
PROGRAM = """import os, sys
print("start", os.getpid(), flush=True)
{before}
import hvdtrain
print("env", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], flush=True)
"""


def launched(tmp_path, before="", extra=None, argv=("a b", "--x=1"), python=(), stdin=None):
    """Run PROGRAM as rank 0 of 2 (OMPI_COMM_WORLD_SIZE=2); (start lines, env lines)."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.format(before=before))
    env = clean_env(tmp_path / "home", **dict({"OMPI_COMM_WORLD_SIZE": "2"}, **(extra or {})))
    cmd = [sys.executable, *python, *([] if stdin else [str(script)]), *argv]
    p = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        input=script.read_text() if stdin else "",
    )
    assert p.returncode == 0, p.stderr
    lines = [l.split(" ", 2) for l in p.stdout.splitlines()]
    return [l[1] for l in lines if l[0] == "start"], [l[1:] for l in lines if l[0] == "env"]


def test_a_launched_rank_starts_again_once_with_the_tunable(tmp_path):
    starts, envs = launched(tmp_path, extra={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    if malloc.unavailable(malloc.glibc_version(), malloc.thp_mode()):
        assert len(starts) == 1
        return
    # the same process (pid), twice from the top, then with the user's tunable kept
    assert len(starts) == 2 and starts[0] == starts[1], starts
    assert envs == [[starts[0], f"glibc.malloc.arena_max=2:{HUGE} ['a b', '--x=1']"]]


@pytest.mark.parametrize(
    "case,before,extra,python,stdin",
    [
        ("not launched", "", {"OMPI_COMM_WORLD_SIZE": "1"}, (), False),
        ("off switch", "", {"HVDTRAIN_HUGETLB": "0"}, (), False),
        ("user's hugetlb=0", "", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, (), False),
        (
            "a thread of the program's",
            "import threading, time\n"
            "threading.Thread(target=time.sleep, args=(2,), daemon=True).start()",
            {},
            (),
            False,
        ),
        ("program from stdin", "", {}, ("-",), True),
        ("interactive", "", {}, ("-i",), False),
        ("a test runner", "import _pytest", {}, (), False),
    ],
)
def test_no_re_exec(tmp_path, case, before, extra, python, stdin):
    starts, envs = launched(tmp_path, before, extra, python=python, stdin=stdin)
    assert len(starts) == 1, case
    assert envs[0][1].split(" [")[0] == str(extra.get("GLIBC_TUNABLES")), (case, envs)


def test_no_re_exec_once_tensorflow_is_imported(tmp_path):
    """Its import would run twice: a script that imports TensorFlow before hvdtrain keeps
    its start (the launch scripts give it the tunable instead)."""
    starts, envs = launched(tmp_path, "import tensorflow")
    assert len(starts) == 1 and envs[0][1].startswith("None"), envs


def test_the_marker_stops_a_second_re_exec(tmp_path):
    """A C library that dropped the variable at start (a sitecustomize removes it here): the
    process starts twice, not for ever."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import os\nos.environ.pop('GLIBC_TUNABLES', None)\n")
    starts, envs = launched(tmp_path, extra={"PYTHONPATH": f"{shim}{os.pathsep}{ROOT}"})
    if malloc.unavailable(malloc.glibc_version(), malloc.thp_mode()) is None:
        assert len(starts) == 2 and envs[0][1].startswith("None"), (starts, envs)
