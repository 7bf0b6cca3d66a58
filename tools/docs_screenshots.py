"""Screenshots of the documentation site at 1280 px, and what is too wide on each page.

    python tools/docs_screenshots.py            # build, serve on 127.0.0.1, screenshot, measure
    python tools/docs_screenshots.py --measure  # measure only, no PNGs written
    python tools/docs_screenshots.py --all      # measure every page of the site, no PNGs

Builds the site (mkdocs build --strict) into a temporary folder, serves it on a loopback port,
and opens each page in headless Chromium with a 1280 x 1600 window:

- writes docs/development/screenshots/NAME.png (the top 1600 px of the page, reduced to a
  palette of 64 colours so that each stays well under 300 KB), which the Development page
  shows;
- prints, per page, every code block and table whose content is wider than its box
  (scrollWidth > clientWidth: it scrolls sideways, nothing is cut) and whether the page itself
  is wider than the window (content run off the edge: cut). It also prints the code font's
  character width and the code block's width in characters, which is where the 100-character
  line limit of tests/unit/test_docs.py (test_no_code_line_is_wider_than_the_page) comes from.

Needs Chromium (Debian: apt-get install -y chromium) and the docs extra (pip install -e
".[docs]"). Exit status 1 when a page is wider than the window.
"""

import argparse
import functools
import glob
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "development", "screenshots")
WIDTH, HEIGHT = 1280, 1600

# (name of the PNG, the page's path in the site)
PAGES = [
    ("home", ""),
    ("getting-started", "getting-started/"),
    ("keras-fit", "guides/keras-fit/"),
    ("cli", "reference/cli/"),
    ("kubernetes", "guides/clusters/kubernetes/"),
    ("api-keras", "reference/api/keras/"),
    ("tracking", "guides/tracking/"),
]

# Runs in the page after Material's own script has wrapped the tables: every code block and
# table, its content width against its box, and the code font's character width.
MEASURE = """
<script>
window.addEventListener("load", () => setTimeout(() => {
  const wide = (el) => el.scrollWidth > el.clientWidth + 1;
  const out = {page: [document.documentElement.scrollWidth,
                      document.documentElement.clientWidth], code: [], tables: []};
  for (const code of document.querySelectorAll(".md-content pre > code")) {
    const lines = code.textContent.split("\\n").map((l) => l.length);
    out.code.push({scrolls: wide(code), width: code.clientWidth, content: code.scrollWidth,
                   longest: Math.max(...lines), first: code.textContent.slice(0, 60)});
  }
  for (const table of document.querySelectorAll(".md-content table")) {
    const wrap = table.closest(".md-typeset__scrollwrap");
    out.tables.push({wrapped: !!wrap, scrolls: wrap ? wide(wrap) : wide(table),
                     first: table.rows[0].textContent.trim().slice(0, 60)});
  }
  const code = document.querySelector(".md-content pre > code");
  if (code) {
    const probe = document.createElement("span");
    probe.textContent = "x".repeat(100);
    code.appendChild(probe);
    out.char_px = probe.getBoundingClientRect().width / 100;
    const style = getComputedStyle(code);
    out.code_box_chars = (code.clientWidth - parseFloat(style.paddingLeft)
                          - parseFloat(style.paddingRight)) / out.char_px;
    probe.remove();
  }
  const pre = document.createElement("pre");
  pre.id = "hvdtrain-measure";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 500));
</script>
"""


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if shutil.which(name):
            return shutil.which(name)
    sys.exit("docs_screenshots: no Chromium found: apt-get install -y chromium (Debian, Ubuntu)")


def build(site):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", site],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if p.returncode:
        sys.exit(f"docs_screenshots: mkdocs build failed:\n{p.stdout}{p.stderr}")


def serve(site):
    """An HTTP server for SITE on 127.0.0.1, a free port; returns its base URL."""
    handler = functools.partial(QuietHandler, directory=site)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def browser(*args):
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={WIDTH},{HEIGHT}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )


def measure(site, base, path):
    """The MEASURE results for PATH, from a copy of the page with the script appended."""
    page = os.path.join(site, path, "index.html")
    probe = os.path.join(site, path, "measure.html")
    with open(page, encoding="utf-8") as f:
        html = f.read()
    with open(probe, "w", encoding="utf-8") as f:
        f.write(html.replace("</body>", MEASURE + "</body>"))
    p = browser("--virtual-time-budget=10000", "--dump-dom", base + path + "measure.html")
    m = re.search(r'<pre id="hvdtrain-measure">(.*?)</pre>', p.stdout, re.S)
    if not m:
        sys.exit(f"docs_screenshots: no measurement from {path or '/'}: {p.stderr[-2000:]}")
    return json.loads(
        m.group(1)
        .replace("&quot;", '"')
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
    )


def screenshot(base, path, png):
    p = browser("--virtual-time-budget=10000", f"--screenshot={png}", base + path)
    if not os.path.exists(png):
        sys.exit(f"docs_screenshots: no screenshot of {path or '/'}: {p.stderr[-2000:]}")
    try:
        from PIL import Image
    except ImportError:
        return  # kept as Chromium wrote it
    Image.open(png).convert("RGB").quantize(colors=64).save(png, optimize=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="measure only, write no PNGs")
    parser.add_argument("--all", action="store_true", help="measure every page, write no PNGs")
    args = parser.parse_args(argv)
    args.measure |= args.all
    chromium()
    pages = list(PAGES)
    if os.path.exists(os.path.join(ROOT, "docs", "reference", "api.md")):
        pages.append(("api", "reference/api/"))
    cut = []
    with tempfile.TemporaryDirectory() as tmp:
        site = os.path.join(tmp, "site")
        build(site)
        base = serve(site)
        if args.all:
            pages = [
                (
                    os.path.dirname(os.path.relpath(p, site)) or "home",
                    os.path.relpath(os.path.dirname(p), site).replace(".", "") + "/",
                )
                for p in sorted(glob.glob(os.path.join(site, "**", "index.html"), recursive=True))
                if "/search/" not in p
            ]
            pages = [(n, "" if p == "/" else p) for n, p in pages]
        if not args.measure:
            os.makedirs(OUT, exist_ok=True)
        for name, path in pages:
            m = measure(site, base, path)
            scrolling = [c for c in m["code"] if c["scrolls"]]
            tables = [t for t in m["tables"] if t["scrolls"]]
            unwrapped = [t for t in m["tables"] if not t["wrapped"]]
            page_cut = m["page"][0] > m["page"][1]
            print(
                f"{name}: {len(m['code'])} code blocks ({len(scrolling)} scroll), "
                f"{len(m['tables'])} tables ({len(tables)} scroll, {len(unwrapped)} not in a "
                f"scroll box); page {m['page'][0]} px in {m['page'][1]}"
                + (" CUT" if page_cut else "")
            )
            if "char_px" in m:
                print(
                    f"  code font: {m['char_px']:.2f} px a character, "
                    f"{m['code_box_chars']:.0f} characters to a code block's width"
                )
            for c in scrolling:
                print(
                    f"  code scrolls: {c['longest']} chars, {c['content']} px in {c['width']}: "
                    f"{c['first']!r}"
                )
            for t in tables + unwrapped:
                print(f"  table {'scrolls' if t['wrapped'] else 'NOT WRAPPED'}: {t['first']!r}")
            if page_cut or unwrapped:
                cut.append(name)
            if not args.measure:
                png = os.path.join(OUT, name + ".png")
                screenshot(base, path, png)
                print(f"  {os.path.relpath(png, ROOT)}: {os.path.getsize(png) // 1024} KB")
    if cut:
        print("cut at 1280 px: " + ", ".join(cut))
    return 1 if cut else 0


if __name__ == "__main__":
    sys.exit(main())
