"""The Dockerfile and the install guide's container commands, read as a builder reads them.

Building the images takes podman and minutes (done by hand; the GPUs guide says what it
measured): these checks hold what makes the build cheap to repeat and the image safe to run,
and they hold the guide's commands to the Dockerfile and scripts/base_image.sh they name.
"""
import os
import re
import shlex
import subprocess

import pytest

from conftest import ROOT
from k8s_cluster import dockerfile_lines
from docs_pages import docs_text
from test_setup_sh import as_user, user_tempdir

pytestmark = pytest.mark.quick
DOCKERFILE = os.path.join(ROOT, "Dockerfile")


def stages():
    """[(FROM line, [(instruction, arguments)])] with continuations joined, comments dropped."""
    out = []
    for line in dockerfile_lines(DOCKERFILE):
        word, _, rest = line.partition(" ")
        if word == "FROM":
            out.append((rest, []))
        elif out:
            out[-1][1].append((word, rest))
    return out


def readme_container_blocks():
    readme = docs_text("guides/install.md")
    section = readme[readme.index("## A container"):]
    section = section[:section.index("\n## ")]
    return re.findall(r"```\n(.*?)```", section, re.S)


def test_the_build_stage_sees_no_hvdtrain_source():
    """An edit to hvdtrain must not recompile Horovod: the stage that builds it copies only
    setup.sh, the patches, setup.py and the lock, and the run-time stage takes its venv before
    it copies hvdtrain."""
    (build_from, build), (_, final) = stages()
    assert build_from.endswith(" AS build")
    copied = [src for word, rest in build if word == "COPY" for src in rest.split()[:-1]]
    assert sorted(copied) == ["constraints.txt", "scripts/patches/", "scripts/setup.sh",
                              "setup.py"]
    assert any(word == "RUN" and "scripts/setup.sh --horovod-only" in rest for word, rest in build)
    order = [(w, r) for w, r in final if w in ("COPY", "RUN")]
    venv = order.index(("COPY", "--from=build /opt/hvdtrain/.venv /opt/hvdtrain/.venv"))
    source = next(i for i, (w, r) in enumerate(order) if w == "COPY" and r.startswith("hvdtrain/"))
    assert venv < source
    # Nothing after the venv installs a dependency: hvdtrain goes in with --no-deps.
    pips = [r for w, r in order[venv:] if w == "RUN" and "pip install" in r]
    assert len(pips) == 1 and "--no-deps" in pips[0] and "[" not in pips[0]


def test_the_runtime_image_is_unprivileged_and_has_no_build_or_test_tools():
    final = stages()[-1][1]
    assert ("USER", "1000:1000") == [(w, r) for w, r in final if w == "USER"][-1]
    installs = " ".join(r for w, r in final if w == "RUN" and "apt-get install" in r)
    for tool in ("g++", "gcc", "cmake", "make ", "-dev", "patchelf"):
        assert tool not in installs, tool
    everything = " ".join(r for _, r in final)
    assert "pytest" not in everything and "[test" not in everything
    # No host key made at build time survives in the image (k8s_worker.sh makes one at start).
    keygen = [r for w, r in final if w == "RUN" and "ssh-keygen" in r]
    assert keygen and all("rm -f /tmp/hostkey" in r for r in keygen)


def test_the_readme_container_commands_name_what_the_image_and_scripts_have():
    blocks = readme_container_blocks()
    commands = [shlex.split(l.split("  #")[0]) for b in blocks for l in b.splitlines()
                if l.strip() and not l.startswith(("COPY", "RUN"))]
    text = open(DOCKERFILE).read()
    args = set(re.findall(r"^ARG (\w+)", text, re.M))
    for cmd in commands:
        for i, word in enumerate(cmd):
            if word == "--build-arg":
                assert cmd[i + 1].split("=")[0] in args, cmd
            if word == "-v":
                target = cmd[i + 1].split(":")[1]
                assert re.search(rf"install -d -o mpiuser -g mpiuser {target}\b", text), target
    # The base image's tag is the one scripts/base_image.sh gives by default.
    base = [c for c in commands if c[:1] == ["scripts/base_image.sh"]]
    assert base and base[0][1:] == ["bookworm"]
    script = open(os.path.join(ROOT, "scripts", "base_image.sh")).read()
    default = re.search(r"^tag=\$\{2:-(\S+)\}$", script, re.M).group(1).replace("$suite", "bookworm")
    built = [c for c in commands if c[:2] == ["podman", "build"]]
    assert built and f"BASE_IMAGE={default}" in built[0]
    # The proxy's CA line names the same build argument and mount point.
    assert re.search(r"-v /etc/ssl/certs/ca-certificates.crt:/run/build-ca.crt:ro "
                     r"--build-arg PIP_CERT=/run/build-ca.crt", docs_text("guides/install.md"))


def test_base_image_refuses_a_user_without_root_in_one_line():
    uid, d = user_tempdir("hvdtrain-base-image-")
    try:
        p = subprocess.run(as_user(uid, ["bash", os.path.join(ROOT, "scripts", "base_image.sh")]),
                           capture_output=True, text=True, timeout=30, cwd=d,
                           env={"PATH": "/usr/sbin:/usr/bin:/bin", "HOME": d})
        assert p.returncode == 1 and p.stdout == ""
        assert p.stderr == ("base_image.sh: error: needs root (debootstrap); run it as root or "
                            "use a registry's debian:bookworm\n"), p.stderr
    finally:
        subprocess.run(["rm", "-rf", d])
