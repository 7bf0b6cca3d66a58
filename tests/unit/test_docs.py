"""The README and the documentation site (mkdocs.yml, docs/): the site builds with warnings
as errors (a broken link or anchor, a page left out of the navigation), the README stays a
short front door, what the README prints is what the examples and the guides hold, and no
page speaks of the project's own history (that is CHANGELOG.md's)."""

import html as html_module
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from docs_pages import ROOT, block, docs_pages, docs_text, readme_text

pytestmark = pytest.mark.quick
DOCS_DIR = os.path.join(ROOT, "docs")
README_LINES = 300


def mkdocs_command():
    """HVDTRAIN_MKDOCS names another mkdocs (a venv of its own); else this venv's, which the
    docs extra installs (scripts/setup.sh)."""
    if os.environ.get("HVDTRAIN_MKDOCS"):
        return shlex.split(os.environ["HVDTRAIN_MKDOCS"])
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (scripts/setup.sh does)")
    return [sys.executable, "-m", "mkdocs"]


@pytest.fixture(scope="module")
def strict_build(tmp_path_factory):
    """The site, built once with warnings as errors: (the build's output, the site's folder)."""
    site = tmp_path_factory.mktemp("strict") / "site"
    p = subprocess.run(
        [
            *mkdocs_command(),
            "build",
            "--strict",
            "--clean",
            "-f",
            os.path.join(ROOT, "mkdocs.yml"),
            "-d",
            str(site),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    return p, site


def test_the_site_builds_with_warnings_as_errors(strict_build):
    p, site = strict_build
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    warnings = [l for l in out.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", l)]
    assert not warnings, "\n".join(warnings)
    # The generated settings table made it into the page, one row per Config field.
    import dataclasses

    from hvdtrain.base.config import Config

    html = (site / "reference" / "cli" / "index.html").read_text()
    for f in dataclasses.fields(Config):
        assert "--" + f.name.replace("_", "-") in html, f.name


# The modules the Python API reference (docs/reference/api/) documents, by their source file.
API_MODULES = {
    "hvdtrain": "hvdtrain/__init__.py",
    "hvdtrain.keras": "hvdtrain/keras.py",
    "hvdtrain.data": "hvdtrain/data.py",
    "hvdtrain.layers": "hvdtrain/layers.py",
    "hvdtrain.ray": "hvdtrain/ray/__init__.py",
    "hvdtrain.spark": "hvdtrain/spark/__init__.py",
}


def public_names(module: str) -> list:
    """A module's ``__all__``, read from its source (importing hvdtrain.keras imports
    TensorFlow)."""
    import ast

    tree = ast.parse(open(os.path.join(ROOT, API_MODULES[module])).read())
    found = [
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
    ]
    assert len(found) == 1, (module, found)
    return found[0]


def documented_objects(site) -> dict:
    """{id: summary} of every object the API pages render (mkdocstrings' headings): the
    first paragraph of its docstring, "" when it has none."""
    out = {}
    for page in (site / "reference" / "api").rglob("index.html"):
        html = page.read_text()
        headings = list(re.finditer(r'<h\d id="([^"]+)" class="doc doc-heading">', html))
        for here, after in zip(headings, headings[1:] + [None]):
            body = html[here.end() : after.start() if after else len(html)]
            first = re.search(r'<div class="doc doc-contents[^"]*">.*?<p>(.*?)</p>', body, re.S)
            text = re.sub(r"<[^>]+>", "", first.group(1)).strip() if first else ""
            out[here.group(1)] = "" if text.endswith(":") else text  # "Returns:": no summary
    return out


def test_every_public_name_is_in_the_api_reference(strict_build):
    """Each name of each documented module's ``__all__`` is an object of the API pages,
    under its public path (``hvdtrain.keras.fit``), with a docstring: a new public name
    needs its docstring and its line (``::: hvdtrain.keras.NAME``) on a page."""
    p, site = strict_build
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    documented = documented_objects(site)
    assert documented["hvdtrain.keras.fit"].startswith("model.fit on every rank")
    missing = [
        f"{m}.{n}" for m in API_MODULES for n in public_names(m) if not documented.get(f"{m}.{n}")
    ]
    assert not missing, f"not in docs/reference/api/, or without a docstring: {missing}"


def test_the_api_reference_speaks_to_users(strict_build):
    """The docstrings the API pages render, held to the rules of the other pages (below): no
    history, not the project's own words, no path into the repository."""
    import html

    p, site = strict_build
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    pages = sorted((site / "reference" / "api").rglob("index.html"))
    assert len(pages) >= 5
    for page in pages:
        text = page.read_text()
        text = html.unescape(re.sub(r"<[^>]+>", "", text[text.index("<article") :]))
        found = [
            m.group(0)
            for pattern in (HISTORY, PROJECT_WORDS, re.compile(r"\bdocs/\S+"))
            for m in pattern.finditer(text)
        ]
        assert not found, (str(page.relative_to(site)), found)


# The widest line of a code block a reader copies. Measured with tools/docs_screenshots.py
# (headless Chromium, 1280 x 1600 window, Material's code font): a character is 8.18 px and a
# code block's box holds 111 characters (the table of contents sits in the left sidebar,
# toc.integrate); 100 leaves the margin of a scroll bar and a narrower window. Program output
# (text and console blocks) is printed as the program prints it and scrolls sideways.
CODE_LINE_LIMIT = 100


@pytest.fixture(scope="module")
def built_site(strict_build):
    """The strict build's site folder (the build must have passed)."""
    p, site = strict_build
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return site


def site_pages(site):
    return sorted(
        str(p.relative_to(site)) for p in site.rglob("index.html") if p.parent.name != "search"
    )


def too_wide(language, line, limit=CODE_LINE_LIMIT):
    """A code line wider than LIMIT that is not program output and not one quoted shell word
    (a JSON or jsonpath argument, which no line break may split)."""
    if len(line) <= limit or language in ("text", "console"):
        return False
    return max(map(len, re.findall(r"'[^']*'", line)), default=0) < 60


def test_too_wide_finds_a_long_command_but_not_output_or_a_quoted_argument():
    assert too_wide("bash", "horovodrun " + "--flag " * 20)
    assert not too_wide("text", "x" * 200) and not too_wide("bash", "ls")
    assert not too_wide("bash", "TF_CONFIG='" + "x" * 100 + "' python train.py")


def test_nothing_is_cut_at_1280_px(built_site):
    """What cuts a page at 1280 px, checked in the built HTML (tools/docs_screenshots.py does it
    in a browser): every code block is a <pre><code> in a highlight div (Material's
    `pre > code { overflow: auto }` scrolls it sideways), every table a plain <table>
    (Material's script wraps each in div.md-typeset__scrollwrap, overflow-x: auto) whose
    code stays on one line (extra.css), and no line a reader copies is wider than the box."""
    assets = built_site / "assets"
    css = "".join(p.read_text() for p in (assets / "stylesheets").glob("main.*.css"))
    js = "".join(p.read_text() for p in (assets / "javascripts").glob("bundle.*.js"))
    assert re.search(r"\.md-typeset pre>code\{[^}]*overflow:auto", css)
    assert re.search(r"\.md-typeset__scrollwrap\{[^}]*overflow-x:auto", css)
    assert 'class:"md-typeset__scrollwrap"' in js and 'class:"md-typeset__table"' in js
    extra = (built_site / "stylesheets" / "extra.css").read_text()
    assert re.search(r"td code,[^{]*\{[^}]*white-space: nowrap", extra), extra
    wide, pages = [], site_pages(built_site)
    assert len(pages) > 30
    for page in pages:
        html = (built_site / page).read_text()
        assert "stylesheets/extra.css" in html, page
        content = html[html.index('<article class="md-content__inner') :]
        content = content[: content.index("</article>")]
        pres = re.findall(r"<pre\b", content)
        # The API reference's signatures are blocks too ("language-python doc-signature"):
        # not copied, they scroll sideways as program output does.
        blocks = re.findall(
            r'<div class="language-(\w+(?: doc-signature)?) highlight"><pre>'
            r"<span></span><code>(.*?)</code></pre></div>",
            content,
            re.S,
        )
        blocks = [
            ("text" if "signature" in language else language, code) for language, code in blocks
        ]
        assert len(blocks) == len(pres), (page, len(blocks), len(pres))
        assert all(
            not re.search(r"<table\s+class=", t) for t in re.findall(r"<table[^>]*>", content)
        ), page
        for language, code in blocks:
            text = html_module.unescape(re.sub(r"<[^>]+>", "", code))
            wide += [(page, len(l), l[:60]) for l in text.splitlines() if too_wide(language, l)]
    assert not wide, wide


def test_the_screenshot_commands_parse_and_the_screenshots_are_shown():
    """The Development page's tools/docs_screenshots.py block: each line's flags parse (its
    --help; the screenshots themselves need Chromium, which CI has not); every page it
    screenshots has its PNG, shown on that page and small."""
    lines = block("development.md", "python tools/docs_screenshots.py").commands()
    assert len(lines) == 2
    for line in lines:
        words = shlex.split(line)
        assert words[:2] == ["python", "tools/docs_screenshots.py"], line
        p = subprocess.run(
            [sys.executable, *words[1:], "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0 and "usage:" in p.stdout, p.stderr
        for flag in words[2:]:
            assert flag in p.stdout, flag
    script = open(os.path.join(ROOT, "tools", "docs_screenshots.py")).read()
    names = re.findall(r'^    \("([\w-]+)", "[\w/-]*"\),$', script, re.M)
    assert "home" in names and "cli" in names, names
    shown = docs_text("development.md")
    for name in names:
        png = os.path.join(DOCS_DIR, "development", "screenshots", name + ".png")
        assert os.path.getsize(png) < 300_000, png
        assert f"(development/screenshots/{name}.png)" in shown, name


def test_the_fit_guide_says_which_settings_hk_fit_takes():
    """The Keras fit guide's table, generated from Config's fit_refusal metadata: each field
    refused by hk.fit with its reason, or taken by its name."""
    import dataclasses

    from hvdtrain.base.config import Config, fit_refusals

    text, refused = docs_text("guides/keras-fit.md"), fit_refusals()
    assert refused
    for f in dataclasses.fields(Config):
        row = f"| `{f.name}` | refused |" if f.name in refused else f"| `{f.name}` | `{f.name}=` |"
        assert row in text, f.name
    # What an argument left at None does, not a literal "none" (hk.fit's docstring says it).
    assert (
        "| `run_dir` | `run_dir=` | an argument of hk.fit, default none (`runs/fit-<time>`) |"
    ) in text


def test_the_cli_page_splits_the_tasks_defaults_out():
    """The settings table has five columns (its meaning column keeps its width at 1280 px);
    the built-in tasks' defaults, where they differ from Config's, are a table of their own."""
    import dataclasses

    from hvdtrain.base.config import Config
    from hvdtrain.tasks.linear import LinearTask
    from hvdtrain.tasks.mnist import MnistTask

    text = docs_text("reference/cli.md")
    assert "| flag | default | defines the run | hk.fit | meaning |" in text
    tables = text.split("| flag | default | linear | mnist |")
    assert len(tables) == 2
    rows = [l for l in tables[1].split("\n\n")[0].splitlines() if l.startswith("| `--")]
    config = Config()
    differ = [
        f.name
        for f in dataclasses.fields(Config)
        if any(
            t.defaults.get(f.name, getattr(config, f.name)) != getattr(config, f.name)
            for t in (LinearTask, MnistTask)
        )
    ]
    assert differ and len(rows) == len(differ), (rows, differ)
    assert "| `--learning-rate` | 0.01 | 0.5 | 0.001 |" in rows


def test_the_readme_is_a_short_front_door():
    lines = readme_text().splitlines()
    assert len(lines) <= README_LINES, len(lines)
    # Its links into the docs point at pages that exist (GitHub renders them; mkdocs does not
    # build the README).
    for target in re.findall(r"\]\((docs/[^)#]+)", readme_text()):
        assert os.path.exists(os.path.join(ROOT, target)), target


def test_every_page_is_in_the_navigation():
    nav = open(os.path.join(ROOT, "mkdocs.yml")).read()
    for page in docs_pages():
        assert page in nav, page


def fences_without_a_language(text):
    """The line numbers of the opening fences of TEXT that name no language (``` alone):
    the site highlights a block by its language, and a reader sees what it is."""
    found, inside = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = re.match(r"\s*(`{3,}|~{3,})\s*(\S*)", line)
        if not m:
            continue
        if inside is None:
            inside = m.group(1)
            if not m.group(2):
                found.append(number)
        elif m.group(1).startswith(inside) and not m.group(2):
            inside = None
    return found


def test_fences_without_a_language_are_found():
    text = "```bash\nls\n```\n\n```\nplain\n```\n  ~~~python\nx = 1\n  ~~~\n````\n"
    assert fences_without_a_language(text) == [5, 11]


@pytest.mark.parametrize("page", ["README.md"] + [f"docs/{p}" for p in docs_pages()])
def test_every_code_block_names_its_language(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        missing = fences_without_a_language(f.read())
    assert not missing, (
        f"{page}: fences with no language (```bash, ```text, ...) at lines {missing}"
    )


def test_the_gpu_status_is_said_where_a_newcomer_looks():
    """The home page and the GPUs guide say it in a warning admonition, the README in a note,
    in the same words: one status, changed in all three places at once."""
    status = "Built and tested on CPU; not yet run on a GPU"
    for page in ("index.md", "guides/gpus.md"):
        assert f'!!! warning "{status}"' in docs_text(page), page
    assert f"> **Note:** {status[0].lower()}{status[1:]}." in readme_text()
    first_screen = "\n".join(readme_text().splitlines()[:12])
    assert "not yet run on a GPU" in first_screen


def test_the_readme_fit_diff_is_the_examples_diff():
    """The README's before/after of a Keras fit script: each removed line is a line of the
    plain script, each added line one of its hvdtrain port."""
    diff = block("README.md", "-from hvdtrain import datasets").text
    examples = os.path.join(ROOT, "examples")
    plain = open(os.path.join(examples, "keras_mnist_plain.py")).read().splitlines()
    ported = open(os.path.join(examples, "keras_fit_mnist.py")).read().splitlines()
    removed = [l[1:] for l in diff.splitlines() if l.startswith("-")]
    added = [l[1:] for l in diff.splitlines() if l.startswith("+")]
    assert removed and added
    for line in removed:
        assert line in plain and line not in ported, line
    for line in added:
        assert line in ported and line not in plain, line


def test_the_readme_task_example_is_the_guides():
    """tests/runs/test_examples.py runs the README's Task example as printed; the Tasks guide
    prints the same."""
    assert (
        block("README.md", "import keras\n").text == block("guides/tasks.md", "import keras\n").text
    )


def test_the_launch_commands_are_the_readmes():
    """Getting started's and the site's home page's three ways to launch are the README's
    Run and cluster commands, which tests/runs/test_multiprocess.py runs as printed (the
    cluster's: tests/clusters/test_multihost.py, on two hosts)."""
    run = block("README.md", "horovodrun -np 2 python -m hvdtrain.mnist").commands()
    cluster = block("README.md", "mpirun -np 8 --hostfile hosts").commands()
    assert len(run) == len(cluster) == 2
    three = [run[0], cluster[0], run[1]]
    assert (
        block("getting-started.md", "horovodrun -np 2 python -m hvdtrain.mnist ").commands()
        == three
    )
    assert block("index.md", "horovodrun -np 2 python -m hvdtrain.mnist ").commands() == three


def test_the_output_sample_is_the_readmes():
    """Getting started prints the README's output sample, which tests/runs/test_multiprocess.py
    compares with what the README's first command prints."""
    assert (
        block("getting-started.md", "hvdtrain: no MNIST found").text
        == block("README.md", "hvdtrain: no MNIST found").text
    )


def test_the_guides_commands_are_the_readmes():
    """The Keras fit guide's and the Tasks guide's run commands are the README's, which
    tests/runs/test_keras_fit.py and tests/runs/test_examples.py run as printed."""
    assert (
        block(
            "guides/keras-fit.md", "horovodrun -np 2 python examples/keras_fit_mnist.py"
        ).commands()
        == block("README.md", "horovodrun -np 2 python examples/keras_fit_mnist.py").commands()
    )
    assert (
        block("guides/tasks.md", "python xor.py").commands()
        == block("README.md", "python xor.py").commands()
    )


def test_the_readme_commands_name_what_exists():
    """Each `python -m MODULE` and `python examples/X.py --flag` of the README and the
    getting-started page names a module or example that exists, and flags it parses."""
    for text in (readme_text(), docs_text("getting-started.md"), docs_text("index.md")):
        for module in re.findall(r"python -m (hvdtrain[\w.]*)", text):
            path = os.path.join(ROOT, *module.split("."))
            assert os.path.exists(path + ".py") or os.path.exists(
                os.path.join(path, "__main__.py")
            ), module
        for script, args in re.findall(r"python (examples/\w+\.py)([^\n#]*)", text):
            source = open(os.path.join(ROOT, script)).read()
            for flag in re.findall(r"(--[\w-]+)", args):
                assert f'"{flag}"' in source, (script, flag)


HISTORY = re.compile(
    r"(?<!horovod)#\d{2,}\b|\b[Ii]ssues? \d+|\b[Rr]ound \d\b|"
    r"\b(this|later|other|previous|earlier) sessions?\b|"
    r"\bprevious (stack|commit|main)\b|\bthe commit before\b"
)


# The Changelog page is CHANGELOG.md, whose subject is the history.
@pytest.mark.parametrize(
    "page", ["README.md"] + [f"docs/{p}" for p in docs_pages() if p != "changelog.md"]
)
def test_no_page_tells_the_projects_history(page):
    text = readme_text() if page == "README.md" else docs_text(page[len("docs/") :])
    found = [m.group(0) for m in HISTORY.finditer(text)]
    assert not found, found


# The project's own words rather than the reader's: the built-in tasks' origin ("the seeds":
# say "the reference programs", which Synchronous training introduces), and the machines it
# is developed on ("tested here", "busy cores", "this project's machines").
PROJECT_WORDS = re.compile(
    r"\bthe seeds?\b(?!\s*(=|of\b|for\b|\)))|\bseed's\b|"
    r"(?<!random )\bseeds'|"
    r"\bseed (documents?|tasks?|programs?)\b|"
    r"\btested here\b|\bbusy cores\b|\bthis project's machines?\b|"
    r"\bmachines? this project has\b",
    re.I,
)


def test_project_words_are_found():
    for said in (
        "the seed's MNIST",
        "as the seeds do",
        "not tested here",
        "on 2 busy cores",
        "on this project's machines",
    ):
        assert PROJECT_WORDS.search(said), said
    for said in ("the seed of the shuffle", "seed=0", "hk.dataset's seed"):
        assert not PROJECT_WORDS.search(said), said


# The project's tests named on a page for users: a path into the test folder (but
# tests/k8s_manifests.py, the manifest check the Kubernetes guide has a user run on a copy of
# the manifests), what "the tests" check or where a thing is "tested in", what the cluster
# emulation proves, what was "seen here". Telling a user to run the tests (`scripts/test.sh
# --quick`) is not among them; the Development section may say all of it.
TEST_WORDS = re.compile(
    r"(?<![\w.-])tests/(?!k8s_manifests\.py\b)|\bthe tests (check|show)|"
    r"\btested in\b|\bemulation proves\b|\bseen here\b|"
    r"\bthe tests here\b|\bhvdtrain's tests\b",
    re.I,
)


def test_test_words_are_found():
    for said in (
        "(tested in tests/runs/test_fit.py)",
        "`tests/clusters/test_slurm.py` builds",
        "the tests check that every rank stops",
        "What the emulation proves",
        "seen here, not a test",
        "1 of 6 such stops in the tests here",
        "hvdtrain's tests do not cover it",
    ):
        assert TEST_WORDS.search(said), said
    for said in (
        "scripts/test.sh --quick",
        "python tests/k8s_manifests.py DIR",
        "the test accuracy",
        'pip install ".[test,bench,docs]"',
        "interested in",
        "every rank stops at the same step",
    ):
        assert not TEST_WORDS.search(said), said


def development_pages():
    """The pages under the Development section of mkdocs.yml's navigation: for the people
    who work on hvdtrain, so they may speak of its machines and its tests."""
    import yaml

    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = yaml.load(f, Loader=yaml.BaseLoader)["nav"]

    def pages(entry):
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [p for e in entry for p in pages(e)]
        return [p for value in entry.values() for p in pages(value)]

    (section,) = [e["Development"] for e in nav if isinstance(e, dict) and "Development" in e]
    return set(pages(section))


def test_the_development_section_holds_the_lab_pages():
    dev = development_pages()
    assert {
        "development.md",
        "concepts/architecture.md",
        "reference/horovod-upstream.md",
        "performance/speed.md",
        "changelog.md",
    } <= dev
    assert not dev & {
        "index.md",
        "performance/index.md",
        "performance/reproduce.md",
        "reference/cli.md",
        "guides/gpus.md",
    }


@pytest.mark.parametrize(
    "page", ["README.md"] + [f"docs/{p}" for p in docs_pages() if p not in development_pages()]
)
def test_no_user_page_speaks_the_projects_own_words(page):
    text = readme_text() if page == "README.md" else docs_text(page[len("docs/") :])
    found = [m.group(0) for pattern in (PROJECT_WORDS, TEST_WORDS) for m in pattern.finditer(text)]
    assert not found, found


def test_the_help_speaks_to_users():
    """--help's descriptions and settings (the CLI reference's tables are made from them)."""
    import dataclasses

    from hvdtrain.base.config import Config
    from hvdtrain.tasks.linear import LinearSettings, LinearTask
    from hvdtrain.tasks.mnist import MnistSettings, MnistTask

    said = [LinearTask.description, MnistTask.description] + [
        f.metadata.get("help", "")
        for cls in (Config, LinearSettings, MnistSettings)
        for f in dataclasses.fields(cls)
    ]
    found = [m.group(0) for text in said for m in PROJECT_WORDS.finditer(text)]
    assert not found, found


def test_the_tasks_guide_command_lines_parse(tmp_path):
    """The Tasks guide's command-line block, each line run with --help (the flags parsed, the
    task found, nothing trained); `workers` prints its count. xor.py is the README's Task
    example, which tests/runs/test_examples.py trains."""
    lines = block("guides/tasks.md", "python -m hvdtrain.mnist --help").commands()
    (tmp_path / "xor.py").write_text(block("README.md", "import keras\n").text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    assert len(lines) == 4
    for words in map(str.split, lines):
        assert words[:3] == ["python", "-m", words[2]] and words[2].startswith("hvdtrain")
        argv = [sys.executable, *words[1:]]
        if "workers" not in words and "--help" not in words:
            argv.append("--help")
        p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (words, p.stderr[-2000:])
        if "workers" in words:
            assert p.stdout.strip() == "2", p.stdout
        else:
            assert "--learning-rate" in p.stdout, p.stdout[-500:]


def test_the_test_commands_are_what_ci_and_the_inner_loop_run(tmp_path):
    """The README's and the Development page's test commands: `scripts/test.sh` is what CI
    runs (.ci/run); `scripts/test.sh --quick`, run as printed (the set-up skipped: this
    environment is set up), selects exactly the quick tier, a strict part of the suite."""
    quick, full = block("README.md", "scripts/test.sh --quick").commands()
    assert block("development.md", "scripts/test.sh\n").commands() == [full]
    assert block("development.md", "scripts/test.sh --quick").commands() == [quick]
    ci = [shlex.split(l) for l in open(os.path.join(ROOT, ".ci", "run")) if l.startswith("exec ")]
    assert len(ci) == 1 and ci[0][1:3] == ["bash", *full.split()], ci
    env = dict(os.environ, HVDTRAIN_SETUP="0", HVDTRAIN_TEST_WORKERS="1")
    env.pop("PYTEST_ADDOPTS", None)

    def collected(argv):
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, (argv, p.stdout[-2000:], p.stderr[-2000:])
        return p.stdout, {l for l in p.stdout.splitlines() if "::" in l}

    out, by_script = collected(["bash", "-c", quick + " --collect-only -q -p no:cacheprovider"])
    assert "quick pass" in out, out[-500:]  # its closing summary
    _, marked = collected(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "quick",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
        ]
    )
    _, everything = collected(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    )
    assert by_script == marked and 0 < len(marked) < len(everything), (
        len(by_script),
        len(marked),
        len(everything),
    )


def test_the_documentation_commands_install_serve_and_build(tmp_path):
    """The Development page's documentation block: the docs extra resolves from what is
    installed (pip's --dry-run, offline); `mkdocs serve` serves the site on 127.0.0.1:8000 (in
    a network namespace of its own, so the port is free); `mkdocs build --strict -d site`
    builds it (into a temporary folder instead of site/)."""
    install, serve, build = block("development.md", 'pip install -e ".[docs]"').commands()
    words = shlex.split(install)
    assert words[:2] == ["pip", "install"]
    p = subprocess.run(
        [sys.executable, "-m", *words, "--dry-run", "--no-index", "--no-build-isolation"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "Would install hvdtrain" in p.stdout, p.stdout + p.stderr
    words = shlex.split(build)
    assert words[:3] == ["mkdocs", "build", "--strict"]
    site = tmp_path / "site"
    p = subprocess.run(
        [*mkdocs_command(), *words[1:], "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert (site / "index.html").exists() and not os.path.exists(os.path.join(ROOT, "site"))
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("mkdocs serve: needs root for a network namespace of its own")
    assert serve == "mkdocs serve"
    driver = f"""
import subprocess, sys, time, urllib.request
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
server = subprocess.Popen({[*mkdocs_command(), "serve"]!r}, cwd={ROOT!r},
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(240):
        try:
            page = urllib.request.urlopen("http://127.0.0.1:8000/getting-started/", timeout=2)
            print(page.status, page.read().decode().count("Getting started"))
            break
        except OSError:
            time.sleep(0.5)
finally:
    server.terminate()
    server.wait(timeout=30)
"""
    p = subprocess.run(
        ["unshare", "--net", "--fork", sys.executable, "-c", driver],
        capture_output=True,
        text=True,
        timeout=180,
        # TMPDIR: the site mkdocs serve builds (a mkdtemp folder it leaves when terminated)
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1", TMPDIR=str(tmp_path)),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    status, mentions = p.stdout.split()
    assert status == "200" and int(mentions) > 0, p.stdout


def test_the_cli_pages_summary_lines_run(tmp_path):
    """The command-line page's summary, each line with its placeholders filled in (TASK:
    linear; package.module:Class: the README's Task example; [flags]: --help, or for
    `workers`, --num-workers 3, which it prints, and for `run-dir`, a --run-dir, which it
    prints as an absolute path)."""
    lines = block("reference/cli.md", "python -m hvdtrain.mnist [flags]").commands()
    assert len(lines) == 7
    (tmp_path / "xor.py").write_text(block("README.md", "import keras\n").text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    for line in lines:
        filled = line.replace("package.module:Class", "xor:Xor").replace("TASK", "linear")
        words = shlex.split(filled)
        assert words[:2] == ["python", "-m"], line
        if "workers" in words:
            words = [w for w in words if w != "[flags]"] + ["--num-workers", "3"]
        elif "run-dir" in words:
            words = [w for w in words if w != "[flags]"] + [
                "--run-dir",
                "runs/a",
                "--epochs",
                "2",
                "--run-dir=runs/b",
            ]
        else:
            words = [w for w in words if w != "[flags]"] + ["--help"]
        p = subprocess.run(
            [sys.executable, *words[1:]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, (line, p.stderr[-2000:])
        if "workers" in words:
            assert p.stdout.strip() == "3", p.stdout
        elif "run-dir" in words:  # the last one, as training takes it
            assert p.stdout == f"{tmp_path}/runs/b\n", p.stdout
        else:
            assert "usage: " in p.stdout, (line, p.stdout[-500:])


def held_blocks():
    """(page, first) of every block(PAGE, FIRST) call with literal strings in tests/."""
    import ast

    held = {}
    tests = os.path.join(ROOT, "tests")
    for folder, dirs, files in os.walk(tests):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith(".py") or name == "docs_pages.py":
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                func = getattr(node, "func", None)
                if (
                    isinstance(node, ast.Call)
                    and len(node.args) == 2
                    and getattr(func, "id", getattr(func, "attr", None)) == "block"
                    and all(
                        isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args
                    )
                ):
                    held.setdefault(tuple(a.value for a in node.args), []).append(
                        os.path.relpath(path, tests)
                    )
    return held


def test_every_code_block_is_held_by_a_test():
    """Every command and code block a reader copies from the README or the site is executed or
    checked by a test, which names it with docs_pages.block(PAGE, FIRST): a block no test
    names fails here, with where it is."""
    from docs_pages import all_pages, block, code_blocks

    held = held_blocks()
    bound = {repr(block(page, first)) for page, first in held}  # each names exactly one block
    loose = [repr(b) for page in all_pages() for b in code_blocks(page) if repr(b) not in bound]
    assert not loose, "no test holds these blocks:\n" + "\n".join(loose)
