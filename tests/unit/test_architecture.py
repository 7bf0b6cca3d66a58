"""The architecture page's picture and table are the layers' import contracts: pyproject.toml's
[tool.importlinter], which lint-imports checks (scripts/test.sh's checks, the pre-commit hook).
The picture's floors are the layers contract, each row of the table one package's forbidden
contract (what it may not import), the contracts hold of the code, and a backward import breaks
them; the layout block names what the repository holds."""

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from docs_pages import ROOT, block, docs_text

pytestmark = pytest.mark.quick
PACKAGE = os.path.join(ROOT, "hvdtrain")
# The venv's own (the test extra): lint-imports beside this Python.
LINT_IMPORTS = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def packages():
    return sorted(
        d for d in os.listdir(PACKAGE) if os.path.exists(os.path.join(PACKAGE, d, "__init__.py"))
    )


def faces():
    return sorted(
        f[:-3]
        for f in os.listdir(PACKAGE)
        if f.endswith(".py") and f != "__init__.py" and f != "__main__.py"
    )


def contracts():
    """pyproject.toml's import contracts, by id."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        settings = tomllib.load(f)["tool"]["importlinter"]
    assert settings["root_package"] == "hvdtrain"
    return {c["id"]: c for c in settings["contracts"]}


def floors():
    """The picture's floors, top first: each a list of the names that start its cells."""
    picture = block("concepts/architecture.md", "  your script ").text
    out = []
    for line in picture.splitlines():
        cells = line.rstrip().split("|")[1:-1]
        if line.startswith(" | ") and not cells[0].startswith("  "):  # a floor's first line
            out.append([re.match(r"\s*(\w+)", cell).group(1) for cell in cells])
    return out


# Public faces that are packages (their modules are entry points, with the faces' rule):
# ``python -m hvdtrain.bench``; the cluster fronts ``python -m hvdtrain.ray`` and ``python -m
# hvdtrain.spark``, and ``jobs`` (what they share: ``python -m hvdtrain.jobs.worker``).
FACE_PACKAGES = ("bench", "jobs", "ray", "spark")


def may_import():
    """The architecture page's table: package -> the names its "may import" cell gives."""
    out = {}
    for row in re.findall(
        r"^\| `hvdtrain/(\w+)/` \|.*\| ([^|]*) \|$", docs_text("concepts/architecture.md"), re.M
    ):
        out[row[0]] = set(re.findall(r"`(\w+)`", row[1]))
    return out


def everything_but(*names):
    """hvdtrain's top-level modules and packages other than NAMES, as contracts name them."""
    return {f"hvdtrain.{n}" for n in packages() + faces() if n not in names}


def lint_imports(cwd=ROOT):
    """lint-imports on the hvdtrain and pyproject.toml in CWD: (status, its output)."""
    out = subprocess.run(
        [LINT_IMPORTS, "--no-cache", "--no-logo"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.returncode, out.stdout + out.stderr


def test_the_picture_draws_every_package_on_a_floor():
    drawn = floors()
    assert drawn[0][0] == "faces", drawn
    below = [name for floor in drawn[1:] for name in floor]
    assert sorted(below) == sorted(p for p in packages() if p not in FACE_PACKAGES), below
    names = block("concepts/architecture.md", "  your script ").text
    for face in faces():  # the faces row names every module at the top
        assert re.search(rf"\b{face}\b", names), face


def test_the_picture_is_the_layers_contract():
    layers = contracts()["layers"]
    assert layers["type"] == "layers" and layers["containers"] == ["hvdtrain"]
    assert [[n.strip() for n in layer.split("|")] for layer in layers["layers"]] == floors()[1:]
    # "|": siblings on one floor import neither the other (tasks and fit, inputs and distributed).
    assert all("|" in layer or " " not in layer.strip() for layer in layers["layers"])


def test_each_row_of_the_table_is_a_contract():
    drawn = floors()
    level = {name: len(drawn) - i for i, floor in enumerate(drawn) for name in floor}
    allowed = may_import()
    assert set(allowed) == {p for p in packages() if p not in FACE_PACKAGES}, allowed
    held = contracts()
    for package, cell in allowed.items():
        contract = held[package]
        assert contract["type"] == "forbidden", package
        assert contract["source_modules"] == [f"hvdtrain.{package}"], package
        assert set(contract["forbidden_modules"]) == everything_but(package, *cell), package
        for name in cell:
            if name in level:  # a package: on a lower floor
                assert level[name] < level[package], (package, name)
            else:  # a face named in the cell: a leaf that imports nothing of hvdtrain
                leaf = held[name]
                assert name in faces() and leaf["source_modules"] == [f"hvdtrain.{name}"], name
                assert set(leaf["forbidden_modules"]) == everything_but(name), name
    # Nothing imports the bench (the developers' optional part): no face here, and no package
    # below by the package contracts above.
    faces_rule = held["faces"]
    assert set(faces_rule["source_modules"]) == everything_but("bench", "_version", *level), (
        faces_rule
    )
    assert faces_rule["forbidden_modules"] == ["hvdtrain.bench"]
    assert all("hvdtrain.bench" in held[p]["forbidden_modules"] for p in level), held


def test_the_contracts_hold():
    status, out = lint_imports()
    assert status == 0, out
    assert f"Contracts: {len(contracts())} kept, 0 broken." in out, out


def test_a_backward_import_fails_the_check(tmp_path):
    """The check above can fail: base importing the engine is caught, by both the floors and
    base's own contract."""
    shutil.copytree(
        PACKAGE, tmp_path / "hvdtrain", ignore=shutil.ignore_patterns("__pycache__", "resources")
    )
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    (tmp_path / "hvdtrain" / "base" / "bad.py").write_text(
        "from hvdtrain.engine.run import Run\nimport hvdtrain.base.config\n"
    )
    status, out = lint_imports(tmp_path)
    assert status == 1, out
    assert f"Contracts: {len(contracts()) - 2} kept, 2 broken." in out, out
    assert "hvdtrain.base.bad -> hvdtrain.engine.run (l.1)" in out, out


def test_the_layout_block_names_what_the_repository_holds():
    layout = block("concepts/architecture.md", "examples/ ").text
    tops = re.findall(r"^(\S+)", layout, re.M)
    for top in tops:
        assert os.path.exists(os.path.join(ROOT, top)), top
    named = set(re.findall(r"([\w.-]+\.(?:py|sh|txt))\b", layout))
    where = {"examples/": "examples", "scripts/": "scripts", "tests/": "tests"}
    for top, folder in where.items():
        section = layout[layout.index(top) :]
        nxt = [layout.index(t) for t in tops if layout.index(t) > layout.index(top)]
        section = layout[layout.index(top) : min(nxt) if nxt else len(layout)]
        here = set(re.findall(r"([\w.-]+\.(?:py|sh))\b", section))
        files = {
            f
            for f in os.listdir(os.path.join(ROOT, folder))
            if f.endswith((".py", ".sh")) and f not in ("__init__.py",)
        }
        assert here <= files, (top, here - files)  # each one named exists
        assert files <= here, (top, files - here)  # each one there is named
    assert named


def test_no_test_module_imports_one_of_another_tier():
    """A tier runs alone (pytest tests/runs): what a test shares with another folder's tests is
    in a helper at tests/'s root, never imported from another folder's test module."""
    tests = os.path.join(ROOT, "tests")
    tier_of = {}
    for tier in ("unit", "runs", "faults", "clusters"):
        for f in os.listdir(os.path.join(tests, tier)):
            if f.startswith("test_") and f.endswith(".py"):
                tier_of[f[:-3]] = tier
    crossing = []
    for module, tier in tier_of.items():
        path = os.path.join(tests, tier, module + ".py")
        for node in ast.walk(ast.parse(open(path).read())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            crossing += [
                f"{tier}/{module} imports {tier_of[n]}/{n}"
                for n in names
                if n in tier_of and tier_of[n] != tier
            ]
    assert len(tier_of) > 30 and not crossing, crossing


def test_the_drivers_set_no_attribute_of_the_run_and_fit_run_declares_its_own():
    """The engine's contract: neither driver assigns to an attribute of the Run (they call
    its methods), and FitRun, the controller Keras' callback talks to, first sets every
    attribute of its own in __init__."""

    def tree(path):
        return ast.parse(open(os.path.join(ROOT, "hvdtrain", path)).read())

    def targets(node):
        for n in ast.walk(node):
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    yield from (e for e in ast.walk(t) if isinstance(e, ast.Attribute))

    def owner(attribute):  # run.x, self.run_.x, run.dog.x -> "run", "run_", ...
        value = attribute.value
        while isinstance(value, ast.Attribute):
            if value.attr == "run_":
                return "run_"
            value = value.value
        return value.id if isinstance(value, ast.Name) else None

    for path in ("tasks/train.py", "tasks/epochs.py", "fit/driver.py", "fit/steps.py"):
        set_on_run = [
            f"{path}:{t.lineno}" for t in targets(tree(path)) if owner(t) in ("run", "run_")
        ]
        assert not set_on_run, set_on_run
    (fit_run,) = [
        n for n in tree("fit/driver.py").body if isinstance(n, ast.ClassDef) and n.name == "FitRun"
    ]
    methods = {f.name: f for f in fit_run.body if isinstance(f, ast.FunctionDef)}

    def own(function):
        return {
            t.attr
            for t in targets(function)
            if isinstance(t.value, ast.Name) and t.value.id == "self"
        }

    declared = own(methods.pop("__init__"))
    later = {name: own(f) - declared for name, f in methods.items()}
    assert not any(later.values()), later
    source = open(os.path.join(ROOT, "hvdtrain", "fit", "driver.py")).read()
    assert "getattr(self" not in source and "FINISHED_HERE" not in source
