"""Guides' code blocks held against code that runs, without running anything more: the lines
of the Keras patterns page are those of tests/keras_patterns.py, which
tests/runs/test_keras_fit_patterns.py runs on two ranks (its opening script a whole one:
every name it reads bound in it); its data lines are examples/keras_fit_mnist.py's, which
tests/runs/test_keras_fit.py runs; Your own data's commands parse with the MNIST task's own
parser, in this process."""

import ast
import builtins
import os
import shlex

import pytest

from docs_pages import ROOT, block

pytestmark = pytest.mark.quick

PATTERNS = "guides/keras-fit-patterns.md"


def code_lines(text):
    """TEXT's lines as Python reads them: stripped, blank lines left out."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def patterns_source(*functions):
    """The lines of tests/keras_patterns.py up to its first function (its imports), then those
    of each named function, in that order."""
    with open(os.path.join(ROOT, "tests", "keras_patterns.py")) as f:
        source = f.read()
    tree = ast.parse(source)
    lines = source.splitlines()
    first = min(n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    out = lines[: first - 1]
    nodes = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in functions:
        node = nodes[name]
        out += lines[node.lineno - 1 : node.end_lineno]
    return code_lines("\n".join(out))


def in_order(lines, source):
    """The lines of LINES not found, in order, among SOURCE's (each at most once)."""
    missing, at = [], 0
    for line in lines:
        try:
            at = source.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


def unbound_names(text):
    """The names TEXT reads that it neither assigns, imports nor has as builtins."""
    tree = ast.parse(text)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.comprehension):
            bound.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    return sorted(
        {
            n.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound
        }
    )


def test_unbound_names_are_found():
    assert unbound_names("import numpy as np\nx = np.ones(3)\nprint(x, y)") == ["y"]
    assert unbound_names("z = [a for a in range(3)]") == []


def test_the_patterns_pages_transfer_script_is_the_two_phases_that_run():
    """The opening script: the scenario two_phase (its data: tl_data, which returns x and the
    label that the script assigns to y; hk.init: main) line for line, in order, with a run
    directory of its own; a whole script (it compiles, and reads no name it does not bind)."""
    text = block("guides/keras-fit-patterns.md", "import numpy as np\n").text
    compile(text, PATTERNS, "exec")
    assert unbound_names(text) == []
    source = patterns_source("main", "tl_data", "two_phase")
    tl_data = patterns_source("tl_data")
    (label,) = [l[len("return x, ") :] for l in tl_data if l.startswith("return x, ")]
    glue = {f"y = {label}", 'run_dir = "runs/tl"'}
    lines = code_lines(text)
    assert glue <= set(lines)
    assert in_order([l for l in lines if l not in glue], source) == []
    # Both phases are there: the frozen base's fit into head/, the whole model's into finetune/.
    assert [l for l in lines if "hk.fit(" in l] == [
        'head = hk.fit(model, train, epochs=2, run_dir=run_dir + "/head", verbose=0)',
        'whole = hk.fit(model, train, epochs=2, run_dir=run_dir + "/finetune", verbose=0)',
    ]


@pytest.mark.parametrize(
    "shown, functions",
    [
        (block("guides/keras-fit-patterns.md", "model.compile(\n"), ("dicts",)),
        (
            block("guides/keras-fit-patterns.md", "lookup = k.layers.StringLookup("),
            ("vocab_adapt",),
        ),
    ],
    ids=["dicts", "adapt"],
)
def test_the_patterns_pages_lines_are_the_scenarios(shown, functions):
    """Each fragment of the page: lines of the scenario that runs it, in order."""
    compile(shown.text, PATTERNS, "exec")
    assert in_order(code_lines(shown.text), patterns_source(*functions)) == []


def test_the_patterns_pages_data_lines_are_the_examples():
    shown = block(
        "guides/keras-fit-patterns.md", "(x_train, y_train), (x_test, y_test) = hk.datasets.mnist()"
    )
    with open(os.path.join(ROOT, "examples", "keras_fit_mnist.py")) as f:
        example = code_lines(f.read())
    assert in_order(code_lines(shown.text), example) == []


def test_the_data_guides_commands_parse(tmp_path, monkeypatch):
    """Your own data's two MNIST commands: the MNIST task's parser takes each (its data
    directory made here), and they ask for what the page says."""
    from hvdtrain.base.flags import parse_args
    from hvdtrain.tasks.mnist import MnistTask

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "mnist").mkdir(parents=True)
    own, fashion = block("guides/data.md", "horovodrun -np 2 python -m hvdtrain.mnist").commands()
    settings = []
    for line in (own, fashion):
        words = shlex.split(line)
        assert words[:6] == ["horovodrun", "-np", "2", "python", "-m", "hvdtrain.mnist"], words
        task = MnistTask()
        config = parse_args(task, words[6:])
        settings.append((config.run_dir, task.settings))
    (run_dir, s), (fashion_dir, f) = settings
    assert (s.dataset, s.data_dir, s.download, run_dir) == (
        "mnist",
        "data/mnist",
        False,
        "runs/mnist",
    )
    assert (f.dataset, fashion_dir) == ("fashion_mnist", "runs/fashion")
