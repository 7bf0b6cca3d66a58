"""The documentation as a reader sees it: README.md and the pages of the docs site (docs/).

Tests that hold a page's commands and code blocks to the code read them through here, so a
page that moves is renamed in one place. ``docs_text`` renders a page's generated parts (the
settings tables of docs/hooks/settings.py) as mkdocs does.
"""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _hook():
    spec = importlib.util.spec_from_file_location(
        "hvdtrain_docs_settings_hook", os.path.join(DOCS, "hooks", "settings.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_text() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def docs_text(page: str) -> str:
    """The Markdown of docs/PAGE (e.g. "guides/install.md"), generated tables filled in."""
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        text = f.read()
    return _hook().render(text) if "{{" in text else text


def docs_pages() -> list:
    """Every page of the site, as paths relative to docs/."""
    out = []
    for folder, dirs, files in os.walk(DOCS):
        dirs[:] = [d for d in dirs if d != "hooks"]
        out += [os.path.relpath(os.path.join(folder, f), DOCS) for f in files if f.endswith(".md")]
    return sorted(out)
