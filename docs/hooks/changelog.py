"""mkdocs hook: the site's Changelog page (docs/changelog.md) is CHANGELOG.md, included whole.

The page writes ``{{ changelog }}``; it is replaced by the repository's CHANGELOG.md with its
links made to work from docs/: ``](docs/X)`` (written for GitHub, from the repository's root)
becomes ``](X)``. A link to another file of the repository would break the strict build, which
says so.
"""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = "{{ changelog }}"


def changelog():
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"\]\(docs/", "](", text)
    # CHANGELOG.md's own title stays the page's one title.
    return re.sub(r"\A# [^\n]*\n", "", text)


def render(markdown):
    return markdown.replace(MARKER, changelog()) if MARKER in markdown else markdown


def on_page_markdown(markdown, page, config, files):
    return render(markdown)
