"""The checks that hold the style: the Development page's commands are what scripts/test.sh
and the pre-commit hooks run, their tools are in the test extra and the lock, and each check
fails on what it is there for (an unused import, a type error; the layers' in
test_architecture.py)."""

import os
import re
import shlex
import subprocess
import sys
import tomllib

import pytest
import yaml

from docs_pages import ROOT, block

pytestmark = pytest.mark.quick
BIN = os.path.dirname(sys.executable)  # the venv's tools (the test extra) beside its Python
TOOLS = {"ruff": "ruff", "mypy": "mypy", "lint-imports": "import-linter"}


def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_page_s_commands_are_the_checks_and_the_hooks():
    commands = [shlex.split(c) for c in block("development.md", "ruff check --fix").commands()]
    assert commands[-1] == ["pre-commit", "install"]
    checked = commands[:-1]
    test_sh = open(os.path.join(ROOT, "scripts", "test.sh")).read()
    (paths,) = re.findall(r"^checks=\((.*)\)$", test_sh, re.M)
    ran = []
    for line in test_sh.splitlines():
        tool = re.match(r'    "\$venv/bin/([\w-]+)" ', line)
        if tool and tool.group(1) in TOOLS:  # the checks: one line each
            words = [tool.group(1), *shlex.split(line.split(" || ")[0])[1:]]
            ran.append(
                [w for word in words for w in (paths.split() if word == "${checks[@]}" else [word])]
            )
    # The page's fix what they can; the checks only say (--check, no --fix), without a cache
    # or lint-imports' logo.
    as_run = [[w for w in c if w not in ("--fix",)] for c in checked]
    as_run[1].insert(2, "--check")
    assert [[w for w in c if w not in ("--no-cache", "--no-logo")] for c in ran] == as_run, ran
    hooks = yaml.safe_load(open(os.path.join(ROOT, ".pre-commit-config.yaml")))["repos"]
    assert [r["repo"] for r in hooks] == ["local"]  # nothing fetched when they run
    entries = [h["entry"].split() for h in hooks[0]["hooks"]]
    assert all(h["language"] == "system" for h in hooks[0]["hooks"])
    assert [e[0] for e in entries] == [".venv/bin/" + c[0] for c in checked]
    assert [e[1:2] for e in entries[:2]] == [c[1:2] for c in checked[:2]]


def test_the_tools_are_in_the_test_extra_and_the_lock():
    extra = pyproject()["project"]["optional-dependencies"]["test"]
    lock = {
        re.sub(r"[-_.]+", "-", line.split("==")[0]).lower()
        for line in open(os.path.join(ROOT, "constraints.txt"))
        if "==" in line
    }
    for name in [*TOOLS.values(), "pre-commit"]:
        assert any(re.match(rf"{name}\b", r) for r in extra), name
        assert name in lock, name


@pytest.fixture
def project(tmp_path):
    """A folder with pyproject.toml's settings and one module, hvdtrain/base/planted.py."""
    (tmp_path / "hvdtrain" / "base").mkdir(parents=True)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        (tmp_path / "pyproject.toml").write_bytes(f.read())
    return tmp_path


def test_an_unused_import_fails_ruff(project):
    (project / "hvdtrain" / "base" / "planted.py").write_text('"""Planted."""\nimport os\n')
    p = subprocess.run(
        [os.path.join(BIN, "ruff"), "check", "--no-cache", "hvdtrain"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and "F401 [*] `os` imported but unused" in p.stdout, p.stdout


def test_a_type_error_fails_mypy(project):
    (project / "hvdtrain" / "base" / "planted.py").write_text(
        '"""Planted."""\n\n\ndef steps(n: int) -> int:\n    return str(n)\n'
    )
    p = subprocess.run(
        [os.path.join(BIN, "mypy"), "--no-incremental", "hvdtrain/base/planted.py"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, p.stdout
    assert (
        'planted.py:5: error: Incompatible return value type (got "str", expected "int")'
        in p.stdout
    ), p.stdout
