"""The lock (constraints.txt): this venv holds exactly its versions, pyproject.toml's pins agree
with it, every pin installs on each Python the docs claim (the distributions' own included:
Debian 12's 3.11.2), and pyproject.toml and scripts/setup.sh ask for that range."""

import importlib.metadata
import os
import re
import tomllib

import pytest

from conftest import ROOT

pytestmark = pytest.mark.quick
LOCK = os.path.join(ROOT, "constraints.txt")


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def locked():
    """{distribution name: version} from constraints.txt's ``name==version`` lines."""
    pins = {}
    for line in open(LOCK):
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    return pins


def drifts(pins):
    """One line per package whose installed version is not the locked one."""
    lines = []
    for name, version in sorted(pins.items()):
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = "not installed"
        if have != version:
            lines.append(f"{name}: locked {version}, installed {have}")
    return lines


def project():
    """pyproject.toml's [project] table: the requirements, the extras, the Python range."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_the_venv_holds_the_locked_versions():
    pins = locked()
    assert len(pins) > 50 and pins["tensorflow"] == "2.21.0"
    assert not any(re.match(r"(horovod|hvdtrain)$", n, re.I) for n in pins)  # built here
    assert drifts(pins) == []


def test_a_drift_is_one_line_naming_the_package():
    pins = locked()
    pins["numpy"] = "1.0.0"
    assert drifts(pins) == [f"numpy: locked 1.0.0, installed {importlib.metadata.version('numpy')}"]


def test_pyproject_pins_are_the_locked_versions():
    kw = project()
    pins = locked()
    exact = [
        r for r in kw["dependencies"] + sum(kw["optional-dependencies"].values(), []) if "==" in r
    ]
    assert exact
    for r in exact:
        name, version = r.split("==")
        assert {canonical(n): v for n, v in pins.items()}[canonical(name)] == version, r
    # The lock's Python range (below); training needs no test or bench tool.
    assert kw["requires-python"] == ">=3.11,<3.14"
    assert not any(re.match(r"(pytest|matplotlib|kubernetes)", r) for r in kw["dependencies"])
    assert "horovod" not in kw["optional-dependencies"]  # built by scripts/setup.sh, not by pip


# The Pythons the docs claim (docs/reference/versions.md), at the first release of each minor:
# a distribution's Python is the minor's release of its day (Debian 12: 3.11.2, Ubuntu 24.04:
# 3.12.3, Debian 13: 3.13.5), never newer than pins written on another machine may need.
CLAIMED = ("3.11.0", "3.12.0", "3.13.0")


def refusing(pins, pythons=CLAIMED):
    """One line per installed pin whose Requires-Python refuses one of ``pythons``."""
    from packaging.specifiers import SpecifierSet

    lines = []
    for name in sorted(pins):
        spec = importlib.metadata.metadata(name).get("Requires-Python")
        if spec:
            refused = [v for v in pythons if not SpecifierSet(spec).contains(v, prereleases=True)]
            if refused:
                lines.append(f"{name}=={pins[name]} needs Python {spec}: not {', '.join(refused)}")
    return lines


def test_every_pin_installs_on_each_claimed_python():
    """pymdown-extensions 13.1.2 (Requires-Python >=3.11.5) made the lock uninstallable on
    Debian 12's own 3.11.2 while every machine with a newer 3.11 passed."""
    assert refusing(locked()) == []


def test_a_pin_that_needs_a_newer_micro_release_is_named():
    lines = refusing({"keras": "3.15.1"}, ("3.10.12", "3.11.0"))
    assert lines == ["keras==3.15.1 needs Python >=3.11: not 3.10.12"]


def test_setup_sh_checks_the_same_range():
    """scripts/setup.sh's interpreter check and message, and pyproject.toml's requires-python,
    say the claimed range: 3.11 to 3.13."""
    setup = open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    assert 'py_range="3.11-3.13"' in setup
    assert "(3, 11) <= sys.version_info[:2] <= (3, 13)" in setup
    assert {v.rsplit(".", 1)[0] for v in CLAIMED} == {"3.11", "3.12", "3.13"}


def test_the_venv_is_made_from_the_python_asked_for():
    """CI sets up with PYTHON=/usr/bin/python3.11 (.ci/run): Debian 12's own interpreter, what
    the README's first command picks on a fresh Debian 12. This venv must be made from it,
    not from another Python first on PATH."""
    asked = os.environ.get("PYTHON")
    if not asked:
        pytest.skip("PYTHON unset: scripts/setup.sh took the first Python 3.11-3.13 on PATH")
    import platform
    import shutil
    import subprocess
    import sys

    path = shutil.which(asked)
    assert path, f"PYTHON={asked} not found"
    assert os.path.realpath(sys._base_executable) == os.path.realpath(path)
    theirs = subprocess.run(
        [path, "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    assert platform.python_version() == theirs
