"""The lock (constraints.txt): this venv holds exactly its versions, setup.py's pins agree with
it, and setup.py asks for the Python versions TensorFlow 2.21 supports."""
import ast
import importlib.metadata
import os
import re

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


def setup_kwargs():
    """setup()'s keyword arguments that are literals, read from setup.py's source."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords
            if isinstance(k.value, (ast.Constant, ast.List, ast.Dict))}


def test_the_venv_holds_the_locked_versions():
    pins = locked()
    assert len(pins) > 50 and pins["tensorflow"] == "2.21.0"
    assert not any(re.match(r"(horovod|hvdtrain)$", n, re.I) for n in pins)  # built here
    assert drifts(pins) == []


def test_a_drift_is_one_line_naming_the_package():
    pins = locked()
    pins["numpy"] = "1.0.0"
    assert drifts(pins) == [f"numpy: locked 1.0.0, installed {importlib.metadata.version('numpy')}"]


def test_setup_py_pins_are_the_locked_versions():
    kw = setup_kwargs()
    pins = locked()
    exact = [r for r in kw["install_requires"] + sum(kw["extras_require"].values(), [])
             if "==" in r]
    assert exact
    for r in exact:
        name, version = r.split("==")
        assert {canonical(n): v for n, v in pins.items()}[canonical(name)] == version, r
    # TensorFlow 2.21's Python range; training needs no test or bench tool.
    assert kw["python_requires"] == ">=3.10,<3.14"
    assert not any(re.match(r"(pytest|matplotlib|kubernetes)", r) for r in kw["install_requires"])
    assert "horovod" not in kw["extras_require"]  # built by scripts/setup.sh, not by pip
