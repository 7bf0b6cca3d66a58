"""mkdocs hook: the settings tables of docs/reference/cli.md, generated from the code.

A page writes ``{{ settings_table }}`` (every field of ``hvdtrain.config.Config``: its flag,
default, the built-in tasks' defaults, and its help) or ``{{ task_settings_table }}`` (the
built-in tasks' own settings). Nothing is copied by hand, so a new field is documented the
moment it exists. tests/docs_pages.py renders a page through ``render`` as mkdocs does.

The modules are loaded without ``hvdtrain/__init__.py`` (which sets up TensorFlow's logging):
``hvdtrain.config`` and the two task modules need only the standard library and numpy.
"""
import contextlib
import dataclasses
import os
import sys
import types
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def _modules():
    """hvdtrain.config and the two tasks; loaded under a bare package (and forgotten after)
    unless hvdtrain is already imported, so that a process that imports hvdtrain later gets
    the real package."""
    import importlib
    before, bare = set(sys.modules), "hvdtrain" not in sys.modules
    if bare:
        package = types.ModuleType("hvdtrain")
        package.__path__ = [os.path.join(ROOT, "hvdtrain")]
        sys.modules["hvdtrain"] = package
    try:
        config = importlib.import_module("hvdtrain.config")
        linear = importlib.import_module("hvdtrain.linear")
        mnist = importlib.import_module("hvdtrain.mnist")
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


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def settings_table():
    with _modules() as (config, linear, mnist):
        return _settings_table(config, linear, mnist)


def _settings_table(config, linear, mnist):
    hints = typing.get_type_hints(config.Config)
    rows = ["| flag | default | linear | mnist | defines the run | meaning |",
            "| --- | --- | --- | --- | --- | --- |"]
    for f in dataclasses.fields(config.Config):
        default = _default(f)
        tasks = [_value(t.defaults.get(f.name, default)) for t in (linear, mnist)]
        defines = "yes" if f.metadata.get("defines_run", True) else "no"
        if f.metadata.get("per_rank"):
            defines += " (per rank)"
        help_ = f.metadata.get("help", "")
        if "choices" in f.metadata:
            help_ += " (choices: " + ", ".join(map(str, f.metadata["choices"])) + ")"
        rows.append(f"| {_flag(f, hints[f.name])} | {_value(default)} | {tasks[0]} | "
                    f"{tasks[1]} | {defines} | {_cell(help_)} |")
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


MARKERS = {"{{ settings_table }}": settings_table,
           "{{ task_settings_table }}": task_settings_table}


def render(markdown):
    """The page's Markdown with every marker replaced by its generated table."""
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


def on_page_markdown(markdown, page, config, files):
    return render(markdown)
