"""The architecture page's picture is the code: each package stands on the floor the picture
draws, imports only what the page's table says it may (and so nothing above it, nothing in a
circle), and the layout block names what the repository holds."""
import ast
import os
import re

import pytest

from docs_pages import ROOT, block, docs_text

pytestmark = pytest.mark.quick
PACKAGE = os.path.join(ROOT, "hvdtrain")


def packages():
    return sorted(d for d in os.listdir(PACKAGE)
                  if os.path.exists(os.path.join(PACKAGE, d, "__init__.py")))


def faces():
    return sorted(f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py"
                  and f != "__main__.py")


def floors():
    """The picture's floors, top first: each a list of the names that start its cells."""
    picture = block("concepts/architecture.md", "  your script ").text
    out = []
    for line in picture.splitlines():
        cells = line.rstrip().split("|")[1:-1]
        if line.startswith(" | ") and not cells[0].startswith("  "):  # a floor's first line
            out.append([re.match(r"\s*(\w+)", cell).group(1) for cell in cells])
    return out


def imports(path):
    """The hvdtrain modules the file at PATH imports, as their first name under hvdtrain."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: a relative import"
            names = [node.module + "." + a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "hvdtrain" and len(parts) > 1:
                out.add(parts[1])
    return out


def imported_by(package):
    """What the modules of hvdtrain/PACKAGE import from hvdtrain, other than the package."""
    found = set()
    for folder, dirs, files in os.walk(os.path.join(PACKAGE, package)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                found |= imports(os.path.join(folder, f))
    return found - {package}


# Public faces that are packages (their modules are entry points, with the faces' rule):
# ``python -m hvdtrain.bench``; the cluster fronts ``python -m hvdtrain.ray`` and ``python -m
# hvdtrain.spark``, and ``jobs`` (what they share: ``python -m hvdtrain.jobs.worker``).
FACE_PACKAGES = ("bench", "jobs", "ray", "spark")


def may_import():
    """The architecture page's table: package -> the names its "may import" cell gives."""
    out = {}
    for row in re.findall(r"^\| `hvdtrain/(\w+)/` \|.*\| ([^|]*) \|$",
                          docs_text("concepts/architecture.md"), re.M):
        out[row[0]] = set(re.findall(r"`(\w+)`", row[1]))
    return out


def test_the_picture_draws_every_package_on_a_floor():
    drawn = floors()
    assert drawn[0][0] == "faces", drawn
    below = [name for floor in drawn[1:] for name in floor]
    assert sorted(below) == sorted(p for p in packages() if p not in ("tools", *FACE_PACKAGES)), below
    names = block("concepts/architecture.md", "  your script ").text
    for face in faces():  # the faces row names every module at the top
        assert re.search(rf"\b{face}\b", names), face


def test_each_package_imports_only_what_the_page_allows_and_only_below_it():
    drawn = floors()
    level = {name: len(drawn) - i for i, floor in enumerate(drawn) for name in floor}
    allowed = may_import()
    assert set(allowed) == {p for p in packages() if p not in FACE_PACKAGES}, allowed
    for package, cell in allowed.items():
        if package == "tools":  # beside the stack: anything of hvdtrain
            continue
        found = imported_by(package)
        assert found <= cell, (package, found - cell)
        for name in cell:
            if name in level:  # a package: on a lower floor
                assert level[name] < level[package], (package, name)
            else:  # a face named in the cell: a leaf that imports nothing of hvdtrain
                assert name in faces() and not imports(os.path.join(PACKAGE, name + ".py")), name
    # Nothing but the bench face imports the tools.
    for face in faces():
        assert "tools" not in imports(os.path.join(PACKAGE, face + ".py")), face
    for package in packages():
        if package not in ("tools", "bench"):
            assert "tools" not in imported_by(package), package
    # The face packages import no tools but the bench's.
    for package in FACE_PACKAGES:
        assert package == "bench" or "tools" not in imported_by(package), package


def test_a_backward_import_fails_the_check(tmp_path):
    """The check above can fail: base importing the engine is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from hvdtrain.engine.run import Run\nimport hvdtrain.base.config\n")
    assert imports(str(bad)) == {"engine", "base"}
    assert not imports(str(bad)) <= may_import()["base"]


def test_the_layout_block_names_what_the_repository_holds():
    layout = block("concepts/architecture.md", "examples/ ").text
    tops = re.findall(r"^(\S+)", layout, re.M)
    for top in tops:
        assert os.path.exists(os.path.join(ROOT, top)), top
    named = set(re.findall(r"([\w.-]+\.(?:py|sh|txt))\b", layout))
    where = {"examples/": "examples", "scripts/": "scripts", "tests/": "tests"}
    for top, folder in where.items():
        section = layout[layout.index(top):]
        nxt = [layout.index(t) for t in tops if layout.index(t) > layout.index(top)]
        section = layout[layout.index(top):min(nxt) if nxt else len(layout)]
        here = set(re.findall(r"([\w.-]+\.(?:py|sh))\b", section))
        files = {f for f in os.listdir(os.path.join(ROOT, folder))
                 if f.endswith((".py", ".sh")) and f not in ("__init__.py",)}
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
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            crossing += [f"{tier}/{module} imports {tier_of[n]}/{n}" for n in names
                         if n in tier_of and tier_of[n] != tier]
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
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    yield from (e for e in ast.walk(t) if isinstance(e, ast.Attribute))

    def owner(attribute):  # run.x, self.run_.x, run.dog.x -> "run", "run_", ...
        value = attribute.value
        while isinstance(value, ast.Attribute):
            if value.attr == "run_":
                return "run_"
            value = value.value
        return value.id if isinstance(value, ast.Name) else None

    for path in ("tasks/train.py", "fit/driver.py"):
        set_on_run = [f"{path}:{t.lineno}" for t in targets(tree(path))
                      if owner(t) in ("run", "run_")]
        assert not set_on_run, set_on_run
    fit_run, = [n for n in tree("fit/driver.py").body
                if isinstance(n, ast.ClassDef) and n.name == "FitRun"]
    methods = {f.name: f for f in fit_run.body if isinstance(f, ast.FunctionDef)}

    def own(function):
        return {t.attr for t in targets(function)
                if isinstance(t.value, ast.Name) and t.value.id == "self"}

    declared = own(methods.pop("__init__"))
    later = {name: own(f) - declared for name, f in methods.items()}
    assert not any(later.values()), later
    source = open(os.path.join(ROOT, "hvdtrain", "fit", "driver.py")).read()
    assert "getattr(self" not in source and "FINISHED_HERE" not in source
