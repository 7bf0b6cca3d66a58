"""mkdocs hook: the settings tables of docs/reference/cli.md, generated from the code.

A page writes ``{{ settings_table }}`` (every field of ``hvdtrain.base.config.Config``: its
flag, default, whether it defines the run, whether ``hk.fit`` takes it, and its help),
``{{ task_defaults_table }}`` (the fields a built-in task sets to another default),
``{{ task_settings_table }}`` (the built-in tasks' own settings) or ``{{ fit_settings_table }}``
(each field as a fit script sets it: an argument of ``hk.fit``, or refused with the reason,
from the fields' ``fit_refusal`` and ``fit_name`` metadata). Nothing is copied by hand, so a
new field is documented the moment it exists. tests/docs_pages.py renders a page through
``render`` as mkdocs does.

The modules are loaded without ``hvdtrain/__init__.py`` (which sets up TensorFlow's logging):
``hvdtrain.base.config``, the two task modules and what they import need only the standard
library and numpy (TensorFlow and Horovod are imported on first use). ``hk.fit``'s named
arguments are read from hvdtrain/keras.py's source, which imports TensorFlow.
"""
import ast
import contextlib
import dataclasses
import os
import re
import sys
import types
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def _modules():
    """hvdtrain.base.config and the two tasks; loaded under a bare package (and forgotten after)
    unless hvdtrain is already imported, so that a process that imports hvdtrain later gets
    the real package."""
    import importlib
    before, bare = set(sys.modules), "hvdtrain" not in sys.modules
    if bare:
        package = types.ModuleType("hvdtrain")
        package.__path__ = [os.path.join(ROOT, "hvdtrain")]
        sys.modules["hvdtrain"] = package
    try:
        config = importlib.import_module("hvdtrain.base.config")
        linear = importlib.import_module("hvdtrain.tasks.linear")
        mnist = importlib.import_module("hvdtrain.tasks.mnist")
        yield config, linear.LinearTask, mnist.MnistTask
    finally:
        for name in (set(sys.modules) - before) if bare else ():
            if name == "hvdtrain" or name.startswith("hvdtrain."):
                del sys.modules[name]


def _flag(f, hint):
    name = "--" + f.name.replace("_", "-")
    base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if base[0] is bool:
        return f"`{name}` / `--no-{f.name.replace('_', '-')}`"
    return f"`{name}`"


def _value(v):
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, (tuple, list)):
        return " ".join(map(str, v))
    return str(v)


def _cell(text):
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace("|", "\\|").replace("\n", " "))


def _cell_with_code(text):
    """_cell, but `code spans` are left as they are (Markdown shows their text literally)."""
    parts = str(text).split("`")
    return "`".join(p if i % 2 else _cell(p) for i, p in enumerate(parts))


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def settings_table():
    with _modules() as (config, linear, mnist):
        return _settings_table(config, linear, mnist)


def _settings_table(config, linear, mnist):
    """flag, Config's default, defines the run, hk.fit, meaning: five columns, so the meaning
    keeps its width at 1280 px (the built-in tasks' defaults are a table of their own)."""
    hints = typing.get_type_hints(config.Config)
    refused = config.fit_refusals()
    rows = ["| flag | default | defines the run | hk.fit | meaning |",
            "| --- | --- | --- | --- | --- |"]
    for f in dataclasses.fields(config.Config):
        defines = "yes" if f.metadata.get("defines_run", True) else "no"
        if f.metadata.get("per_rank"):
            defines += " (per rank)"
        help_ = f.metadata.get("help", "")
        if "choices" in f.metadata:
            help_ += " (choices: " + ", ".join(map(str, f.metadata["choices"])) + ")"
        fit = "no" if f.name in refused else "yes"
        rows.append(f"| {_flag(f, hints[f.name])} | {_value(_default(f))} | {defines} | {fit} | "
                    f"{_cell(help_)} |")
    return "\n".join(rows)


def task_defaults_table():
    with _modules() as (config, linear, mnist):
        return _task_defaults_table(config, linear, mnist)


def _task_defaults_table(config, linear, mnist):
    """The training settings a built-in task sets to another value than Config's default."""
    hints = typing.get_type_hints(config.Config)
    rows = ["| flag | default | linear | mnist |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(config.Config):
        default = _default(f)
        tasks = [t.defaults.get(f.name, default) for t in (linear, mnist)]
        if any(t != default for t in tasks):
            rows.append(f"| {_flag(f, hints[f.name])} | {_value(default)} | "
                        f"{_value(tasks[0])} | {_value(tasks[1])} |")
    return "\n".join(rows)


def task_settings_table():
    with _modules() as (_, linear, mnist):
        return _task_settings_table(linear, mnist)


def _task_settings_table(linear, mnist):
    rows = ["| task | flag | default | meaning |", "| --- | --- | --- | --- |"]
    for task in (linear, mnist):
        hints = typing.get_type_hints(task.Settings)
        for f in dataclasses.fields(task.Settings):
            help_ = f.metadata.get("help", "")
            if "choices" in f.metadata:
                help_ += " (choices: " + ", ".join(map(str, f.metadata["choices"])) + ")"
            rows.append(f"| {task.name} | {_flag(f, hints[f.name])} | "
                        f"{_value(_default(f))} | {_cell(help_)} |")
    return "\n".join(rows)


def fit_named_arguments():
    """{name: required}: the arguments that ``hvdtrain.keras.fit`` names in its signature
    (the others come in through ``**settings``), read from the source without importing it."""
    with open(os.path.join(ROOT, "hvdtrain", "keras.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "fit":
            args = node.args
            positional = args.posonlyargs + args.args
            required = {a.arg: i < len(positional) - len(args.defaults)
                        for i, a in enumerate(positional)}
            required.update({a.arg: d is None for a, d in zip(args.kwonlyargs, args.kw_defaults)})
            return required
    raise LookupError("hvdtrain/keras.py defines no fit()")


def fit_none_meanings():
    """{name: what None means}, from hk.fit's docstring: "``run_dir``: ... (None: X)" says
    what an argument left at None does (``runs/fit-<time>``, not a literal "none")."""
    with open(os.path.join(ROOT, "hvdtrain", "keras.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "fit":
            doc = ast.get_docstring(node) or ""
            # Its Args: section, one entry per argument ("    name: text", continued by
            # deeper-indented lines): "(None: X)" or "None: X;" says what None does.
            args, name = {}, None
            for line in doc.split("Args:", 1)[-1].splitlines():
                entry = re.match(r"    (\w+): (.*)", line)
                if entry:
                    name, args[entry.group(1)] = entry.group(1), entry.group(2)
                elif name and line.startswith("        "):
                    args[name] += " " + line.strip()
                elif line.strip() and not line.startswith(" "):
                    break  # Returns:, Raises:
            out = {}
            for name, text in args.items():
                found = re.search(r"\(None: (.*?)\)|^None: (.*?);", text)
                if found:
                    out[name] = " ".join((found.group(1) or found.group(2)).replace(
                        "``", "`").split())
            return out
    raise LookupError("hvdtrain/keras.py defines no fit()")


def fit_settings_table():
    with _modules() as (config, _, _):
        return _fit_settings_table(config, fit_named_arguments(), fit_none_meanings())


def _fit_settings_table(config, named, none_means=None):
    refused = config.fit_refusals()
    rows = ["| setting | hk.fit | how a fit script sets it |", "| --- | --- | --- |"]
    for f in dataclasses.fields(config.Config):
        if f.name in refused:
            where, name = refused[f.name], config.fit_argument(f.name)
            if name != f.name and name not in where:
                where += f" ({name})"
            rows.append(f"| `{f.name}` | refused | {_cell(where)} |")
        elif named.get(f.name):
            rows.append(f"| `{f.name}` | `{f.name}=` | an argument of hk.fit, required |")
        else:
            how = "an argument of hk.fit" if f.name in named else "a keyword (`**settings`)"
            default = _default(f)
            shown = (f"none ({none_means[f.name]})" if default is None
                     and f.name in (none_means or {}) else _value(default))
            rows.append(f"| `{f.name}` | `{f.name}=` | {how}, default {_cell_with_code(shown)} |")
    return "\n".join(rows)


MARKERS = {"{{ settings_table }}": settings_table,
           "{{ task_defaults_table }}": task_defaults_table,
           "{{ task_settings_table }}": task_settings_table,
           "{{ fit_settings_table }}": fit_settings_table}


def render(markdown):
    """The page's Markdown with every marker replaced by its generated table."""
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


def on_page_markdown(markdown, page, config, files):
    return render(markdown)
