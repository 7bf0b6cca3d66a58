"""The documentation as a reader sees it: README.md and the pages of the docs site (docs/).

Tests that hold a page's commands and code blocks to the code read them through here, so a
page that moves is renamed in one place. ``docs_text`` renders a page's generated parts (the
settings tables of docs/hooks/settings.py, CHANGELOG.md in docs/changelog.md) as mkdocs does.
"""

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _hook(name="settings"):
    spec = importlib.util.spec_from_file_location(
        f"hvdtrain_docs_{name}_hook", os.path.join(DOCS, "hooks", name + ".py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_text() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def docs_text(page: str) -> str:
    """The Markdown of docs/PAGE (e.g. "guides/install.md"), generated tables (and the
    Changelog page's CHANGELOG.md) filled in."""
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        text = f.read()
    if "{{" not in text:
        return text
    return _hook("changelog").render(_hook().render(text))


def docs_pages() -> list:
    """Every page of the site, as paths relative to docs/."""
    out = []
    for folder, dirs, files in os.walk(DOCS):
        dirs[:] = [d for d in dirs if d != "hooks"]
        out += [os.path.relpath(os.path.join(folder, f), DOCS) for f in files if f.endswith(".md")]
    return sorted(out)


class Block:
    """One fenced code block of a page: what a reader copies. ``page`` is "README.md" or a
    path under docs/, ``line`` the line of its opening fence."""

    def __init__(self, page, lang, text, line):
        self.page, self.lang, self.text, self.line = page, lang, text, line

    def __repr__(self):
        first = self.text.splitlines()[0] if self.text else ""
        return f"{self.page}:{self.line}: {first[:70]}"

    def commands(self) -> list:
        """Its command lines as a shell reads them: backslash continuations joined, a trailing
        "  # comment" and comment-only and blank lines left out."""
        out, pending = [], ""
        for line in self.text.splitlines():
            if line.endswith("\\"):
                pending += line[:-1]
                continue
            line, pending = pending + line, ""
            line = re.split(r"\s{2,}#|\s#\s", line)[0].rstrip()
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line.strip())
        return out


def _page_text(page):
    path = os.path.join(ROOT, page) if page == "README.md" else os.path.join(DOCS, page)
    with open(path, encoding="utf-8") as f:
        return f.read()


def code_blocks(page: str) -> list:
    """Every fenced block of PAGE ("README.md", or a page of docs/), in order."""
    text = _page_text(page)
    return [
        Block(page, m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    ]


def block(page: str, first: str) -> Block:
    """The one block of PAGE whose text starts with FIRST. Tests that execute or check a block
    name it this way, with literal strings: tests/unit/test_docs.py reads those calls to find
    any block that no test holds."""
    found = [b for b in code_blocks(page) if b.text.startswith(first)]
    if len(found) != 1:
        raise LookupError(
            f"{len(found)} blocks of {page} start with {first!r}: {code_blocks(page)}"
        )
    return found[0]


def all_pages() -> list:
    return ["README.md"] + docs_pages()
