"""Every outside command the tests and scripts run comes from a Debian package that the
project's own set-up installs (scripts/setup.sh's checks, scripts/setup_test.sh's list), one
those packages depend on, or one every Debian system has (Priority: required): a new Debian 12
machine gets everything CI needs from the README's two commands, not from something installed
by hand (a GPU build test once needed `patchelf`, which nothing installed).

The commands are found by reading the code (``shutil.which("X")``, ``command -v X``,
``subprocess.run(["X", ...``); each must be in COMMANDS below, required or optional (a test
skips without it), so that a new one is classified when it is written."""

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from docs_pages import block

pytestmark = [
    pytest.mark.quick,
    pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not Debian"),
]

# command: None (required: some test or CI step runs it unconditionally), or why it may be
# missing (what skips or falls back without it).
COMMANDS = {
    # scripts/setup.sh's build and launch needs (it installs them as root)
    "c++": None,
    "g++": None,
    "gcc": None,
    "make": None,
    "cmake": None,
    "patch": None,
    "mpicxx": None,
    "mpirun": None,
    "ompi_info": None,
    "mpiexec": "mpirun is enough (setup.sh accepts either)",
    "mpichversion": "MPICH's tool; this machine's MPI is Open MPI",
    "apt-get": None,
    "dpkg-query": None,
    "dpkg": None,
    # scripts/setup_test.sh's
    "patchelf": None,
    "shellcheck": None,
    "sshd": None,
    "ssh": None,
    "ssh-keygen": None,
    "ip": None,
    "java": None,
    "sbatch": None,
    "srun": None,
    "slurmd": None,
    "slurmctld": None,
    "munged": None,
    # util-linux, mount, coreutils, sh: every Debian system
    "setpriv": None,
    "unshare": None,
    "nsenter": None,
    "mount": None,
    "umount": None,
    "bash": None,
    "sh": None,
    "rm": None,
    "env": None,
    "grep": None,
    # the venv's own (scripts/setup.sh installs them with pip)
    "python": None,
    "horovodrun": None,
    "mkdocs": None,
    "pip": None,
    # optional: the tests that use them skip without them
    "kubectl": "the Kubernetes checks run kubectl's own where it is installed",
    "docker": "the image tests build with docker or podman where one is installed",
    "podman": "the image tests build with docker or podman where one is installed",
    "debootstrap": "the Debian roots are made by hand (docs/reference/versions.md)",
    "nvidia-smi": "a GPU machine's",
    "nvcc": "a GPU machine's (the GPU build brings its own)",
}
# What a machine that runs the README's commands has before them: the clone, and the Python.
GIVEN = {"git", "python3.11", "python3.12", "python3.13"}
GIVEN_PACKAGES = {"git", *(f"python3.{m}{s}" for m in (11, 12, 13) for s in ("", "-minimal"))}

FOUND = (
    r'shutil\.which\("([A-Za-z0-9_.+-]+)"\)',
    r"command -v ([A-Za-z0-9_.+-]+)",
    r'subprocess\.(?:run|Popen|check_output|check_call)\(\["([A-Za-z0-9_.+-]+)"',
)


def commands_in_code():
    """{command: first file that runs it} from the tests, the scripts and the package."""
    found = {}
    files = (
        glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True)
        + glob.glob(os.path.join(ROOT, "scripts", "*.sh"))
        + glob.glob(os.path.join(ROOT, "hvdtrain", "**", "*.py"), recursive=True)
        + [os.path.join(ROOT, ".ci", "run")]
    )
    for path in files:
        if path == os.path.abspath(__file__):
            continue
        text = open(path).read()
        for pattern in FOUND:
            for name in re.findall(pattern, text):
                found.setdefault(name, os.path.relpath(path, ROOT))
    return found


def apt_lists():
    """The Debian packages the project's set-up scripts install for CI: setup.sh's `need`
    lines (what, Debian packages, RHEL packages) and setup_test.sh's lists."""
    minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    packages = set()
    for line in open(os.path.join(ROOT, "scripts", "setup.sh")):
        line = line.strip()
        # need WHAT DEBIAN RHEL, each a word or a double-quoted string
        m = re.search(r'\bneed ("[^"]*"|\S+) ("[^"]*"|\S+) ("[^"]*"|\S+)', line)
        # The GPU build's needs (patchelf) count only for HVDTRAIN_GPU=1 with apt-get, which
        # CI's GPU build test does not use (scripts/test_gpu_build.sh: HVDTRAIN_SKIP_APT=1).
        if m and not line.startswith(("need()", "#")) and '"$gpu" == 1' not in line:
            packages.update(shlex.split(m.group(2))[0].replace("$pyver", minor).split())
    text = open(os.path.join(ROOT, "scripts", "setup_test.sh")).read()
    for name in ("packages", "optional"):
        m = re.search(rf"^{name}=\(([^)]*)\)", text, re.M)
        packages.update(m.group(1).split())
    return packages


def dpkg(*args):
    return subprocess.run(["dpkg-query", *args], capture_output=True, text=True, timeout=60).stdout


def owners(paths):
    """{path: the Debian package that installed it, or None}: one dpkg -S for all, each path
    asked as itself, after links, and under usrmerge's other name (/bin is /usr/bin)."""

    def names(path):
        real = os.path.realpath(path)
        for p in dict.fromkeys([path, real]):
            yield p
            yield re.sub(r"^/usr(/s?bin/)", r"\1", p) if p.startswith("/usr/") else "/usr" + p

    asked = {path: list(dict.fromkeys(names(path))) for path in paths}
    out = subprocess.run(
        ["dpkg", "-S", *sorted({n for ns in asked.values() for n in ns})],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    found = {}
    for line in out.splitlines():
        packages, _, p = line.partition(": ")
        if packages.startswith("diversion by"):  # /bin/sh: "diversion by dash from: /bin/sh"
            continue
        found.setdefault(p.strip(), packages.split(",")[0].split(":")[0].strip())
    return {path: next((found[n] for n in ns if n in found), None) for path, ns in asked.items()}


def depends(packages):
    """The packages ``packages`` depend on (one level: g++ brings gcc and g++-12)."""
    out = dpkg("-W", "-f=${Depends},${Pre-Depends}\n", *packages)
    return {re.split(r"[\s(:]", d.strip())[0] for d in re.split(r"[,|]", out) if d.strip()}


def test_every_command_the_code_runs_is_classified():
    unknown = {c: f for c, f in commands_in_code().items() if c not in COMMANDS and c not in GIVEN}
    assert unknown == {}, f"add these to COMMANDS (required, or why optional): {unknown}"


def unmet(commands, installed):
    """One line per required command that the set-up would not bring, given the packages
    ``installed`` by the set-up scripts."""
    allowed = installed | depends(sorted(installed))
    problems, paths = [], {}
    for command in commands:
        # The venv's commands where the tests find them (its bin/, which CI's PATH lacks),
        # and the daemons' sbin/ directories, which a user's PATH may lack.
        path = shutil.which(
            command,
            path=os.pathsep.join(
                [os.path.join(sys.prefix, "bin"), os.environ.get("PATH", ""), "/usr/sbin:/sbin"]
            ),
        )
        if path is None:
            problems.append(f"{command}: not installed")
        elif not os.path.abspath(path).startswith(sys.prefix + os.sep):  # else the venv's
            paths[command] = path
    packages = owners(paths.values())
    for command, path in paths.items():
        package = packages[path]
        if package is None:
            problems.append(f"{command}: {path} belongs to no Debian package")
        elif (
            package not in allowed
            and package not in GIVEN_PACKAGES
            and dpkg("-W", "-f=${Priority}", package) != "required"
        ):
            problems.append(f"{command}: from {package}, which no set-up script installs")
    return problems


REQUIRED = sorted(c for c, why in COMMANDS.items() if why is None)


def test_every_required_command_comes_from_a_package_the_set_up_installs():
    installed = apt_lists()
    assert {"patchelf", "shellcheck", "openssh-server", "cmake", "g++"} <= installed
    assert unmet(REQUIRED, installed) == []


def test_a_command_from_a_package_nobody_installs_is_named():
    """The check fails on what it should: without patchelf in setup_test.sh's list (as it
    was), the GPU build's patchelf is named; a required package's command (coreutils') is
    never a problem."""
    assert unmet(["patchelf", "rm"], apt_lists() - {"patchelf"}) == [
        "patchelf: from patchelf, which no set-up script installs"
    ]


def test_the_java_the_spark_page_installs_is_what_the_tests_run_on():
    (line,) = block("guides/clusters/spark.md", "apt-get install -y openjdk").commands()
    package = line.split()[-1]
    assert package in apt_lists(), package
    assert "java" in {os.path.basename(p) for p in dpkg("-L", package).split()} | {
        os.path.basename(os.path.realpath(shutil.which("java") or ""))
    }
