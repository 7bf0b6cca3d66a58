"""The Dockerfile and the install guide's container commands, read as a builder reads them.

Building the images takes podman and minutes (done by hand; the GPUs guide says what it
measured): these checks hold what makes the build cheap to repeat and the image safe to run,
and they hold the guide's commands to the Dockerfile and scripts/base_image.sh they name.
"""

import json
import os
import re
import shlex
import shutil
import subprocess

import pytest
from test_setup_sh import as_user, user_tempdir

import k8s_manifests as K
from conftest import ROOT
from docs_pages import block, docs_text
from k8s_cluster import dockerfile_lines

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


def test_the_build_stage_sees_no_hvdtrain_source():
    """An edit to hvdtrain must not recompile Horovod: the stage that builds it copies only
    setup.sh, the patches, pyproject.toml and the lock, and the run-time stage takes its venv
    before it copies hvdtrain."""
    (build_from, build), (_, final) = stages()
    assert build_from.endswith(" AS build")
    copied = [src for word, rest in build if word == "COPY" for src in rest.split()[:-1]]
    assert sorted(copied) == [
        "constraints.txt",
        "pyproject.toml",
        "scripts/patches/",
        "scripts/setup.sh",
    ]
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


# Flags that take a value, where the tool is not installed to say so itself.
VALUE_FLAGS = {
    "-t",
    "--tag",
    "-v",
    "--volume",
    "--build-arg",
    "--network",
    "--runtime",
    "--cgroup-manager",
    "-f",
    "--file",
    "--target",
}


def help_flags(tool, command):
    """{flag: takes a value} that `TOOL COMMAND --help` lists (podman's global flags, which
    may follow the command, from `podman --help`); None where the tool is not installed."""
    if shutil.which(tool) is None:
        return None
    flags = {}
    for argv in ([tool, command, "--help"], [tool, "--help"] if tool == "podman" else None):
        if argv:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            assert p.returncode == 0, p.stderr
            for short, name, kind in re.findall(
                r"^\s+(?:-(\w), )?--([\w-]+)(?:[ =](\S+))?", p.stdout, re.M
            ):
                flags.setdefault(f"--{name}", bool(kind))  # the command's own first
                if short:
                    flags.setdefault(f"-{short}", bool(kind))
    assert len(flags) > 3, (tool, command)
    return flags


def image_commands(b):
    """Each docker or podman command of block b, held to the tool, the Dockerfile and the
    scripts: each flag one that `TOOL COMMAND --help` lists (where the tool is installed),
    each --build-arg an ARG of the Dockerfile, a build's context the checkout (.) and its -v
    the CA file its PIP_CERT names, BASE_IMAGE the tag scripts/base_image.sh gives, a run's -v
    a directory the image makes for mpiuser, an image run or pushed one the block builds, and
    a command run in it a module that exists. [(tool, command, {flag: [values]}, arguments)]."""
    text = open(DOCKERFILE).read()
    args = set(re.findall(r"^ARG (\w+)", text, re.M))
    script = open(os.path.join(ROOT, "scripts", "base_image.sh")).read()
    base = (
        re.search(r"^tag=\$\{2:-(\S+)\}$", script, re.M)
        .group(1)
        .replace("$suite", re.search(r"^suite=\$\{1:-(\w+)\}$", script, re.M).group(1))
    )
    built, out = {}, []
    for line in b.commands():
        words = shlex.split(line)
        if words[0] not in ("docker", "podman"):
            continue
        tool, command, rest = words[0], words[1], words[2:]
        if command == "buildx":  # docker's buildx plugin (not installed here): its image only
            assert rest[:2] == ["imagetools", "inspect"] and rest[2] in built, words
            continue
        flags = help_flags(tool, command)
        given, positional = {}, []
        while rest:
            word = rest.pop(0)
            if not word.startswith("-"):
                positional.append(word)
                if command == "run" and positional[1:]:  # the command run in the image
                    positional += rest
                    break
                continue
            name, eq, value = word.partition("=")
            if flags is not None:
                assert name in flags, (words, name)
            takes = flags[name] if flags is not None else name in VALUE_FLAGS
            if takes and not eq:
                value = rest.pop(0)
            given.setdefault(name, []).append(value)
        build_args = dict(v.split("=", 1) for v in given.get("--build-arg", []))
        assert set(build_args) <= args, (words, build_args)
        if "BASE_IMAGE" in build_args:
            assert build_args["BASE_IMAGE"] == base, words
        if command == "build":
            (tag,) = given.get("-t", []) or given["--tag"]
            assert positional == ["."], words
            for volume in given.get("-v", []):  # the proxy's CA, which pip in the build reads
                assert volume.split(":")[1] == build_args["PIP_CERT"], words
            built[tag] = build_args
        elif command == "run":
            image, *cmd = positional
            assert image in built, (words, built)
            for volume in given.get("-v", []):
                target = volume.split(":")[1]
                assert re.search(rf"install -d -o mpiuser -g mpiuser {target}\b", text), target
            if cmd:
                assert cmd[:2] == ["python", "-m"] and os.path.exists(
                    os.path.join(ROOT, *cmd[2].split(".")) + ".py"
                ), words
        elif command == "push":
            assert positional[0] in built and len(positional) == 1, words
        else:
            pytest.fail(f"not checked: {words}")
        out.append((tool, command, given, positional))
    # A tag says which image it is: the CUDA one is built with HVDTRAIN_GPU=1.
    for tag, build_args in built.items():
        assert tag.endswith(":gpu") == (build_args.get("HVDTRAIN_GPU") == "1"), tag
    return out, built


def default_command():
    (cmd,) = [r for w, r in stages()[-1][1] if w == "CMD"]
    return json.loads(cmd)


def test_the_install_guides_container_commands_name_what_the_image_and_scripts_have():
    """The install guide's container blocks: the CPU image built, run with its default
    command (the one its comment names) and with the run directories on the host, and the
    podman build on a base made by scripts/base_image.sh (its default tag)."""
    container = block("guides/install.md", "docker build -t hvdtrain .")
    commands, built = image_commands(container)
    assert [c[:2] for c in commands] == [("docker", "build"), ("docker", "run"), ("docker", "run")]
    assert built == {"hvdtrain": {}}
    comments = dict(re.findall(r"^(\S.*?)\s{2,}#\s*(.*)$", container.text, re.M))
    assert shlex.split(comments["docker run --rm hvdtrain"]) == default_command()
    for name in re.findall(r"--build-arg (\w+)=", comments["docker build -t hvdtrain ."]):
        assert re.search(rf"^ARG {name}\b", open(DOCKERFILE).read(), re.M), name
    on_base = block("guides/install.md", "scripts/base_image.sh bookworm")
    base, podman = [shlex.split(c) for c in on_base.commands()]
    assert base == ["scripts/base_image.sh", "bookworm"]
    commands, built = image_commands(on_base)
    assert [c[:2] for c in commands] == [("podman", "build")] and "BASE_IMAGE" in built["hvdtrain"]
    # The proxy's CA line names the same build argument and mount point as the GPUs guide's.
    assert re.search(
        r"-v /etc/ssl/certs/ca-certificates.crt:/run/build-ca.crt:ro "
        r"--build-arg PIP_CERT=/run/build-ca.crt",
        docs_text("guides/install.md"),
    )


def test_the_gpu_guides_image_builds_are_the_two_images():
    """The GPUs guide's podman commands: both images on the Debian base, the CUDA one with
    HVDTRAIN_GPU=1, each run (the CPU one with its default command, the CUDA one's doctor)."""
    commands, built = image_commands(block("guides/gpus.md", "podman build --runtime runc"))
    assert [c[:2] for c in commands] == [("podman", "build")] * 2 + [("podman", "run")] * 2
    assert set(built) == {"hvdtrain:cpu", "hvdtrain:gpu"}
    assert [c[3][0] for c in commands[2:]] == ["hvdtrain:cpu", "hvdtrain:gpu"]


def test_the_kubernetes_guides_images_are_the_overlays():
    """The Kubernetes guide's builds and pushes: the CPU and CUDA images under the name the
    overlays pull (newName), the CUDA one what the GPU overlay's workers run, the CPU one
    every other pod's."""
    commands, built = image_commands(
        block("guides/clusters/kubernetes.md", "docker build -t registry.example.com/hvdtrain:cpu")
    )
    assert [c[1] for c in commands] == ["build", "build", "push", "push"]
    for overlay in ("cpu", "gpu"):
        kustomization = K.yaml.safe_load(
            open(os.path.join(K.DEPLOY, "overlays", overlay, "kustomization.yaml"))
        )
        for image in kustomization["images"]:
            flavour = "gpu" if (overlay, image["name"]) == ("gpu", "hvdtrain") else "cpu"
            assert f"{image['newName']}:{flavour}" in built, (overlay, image)


def test_base_image_refuses_a_user_without_root_in_one_line():
    uid, d = user_tempdir("hvdtrain-base-image-")
    try:
        p = subprocess.run(
            as_user(uid, ["bash", os.path.join(ROOT, "scripts", "base_image.sh")]),
            capture_output=True,
            text=True,
            timeout=30,
            cwd=d,
            env={"PATH": "/usr/sbin:/usr/bin:/bin", "HOME": d},
        )
        assert p.returncode == 1 and p.stdout == ""
        assert p.stderr == (
            "base_image.sh: error: needs root (debootstrap); run it as root or "
            "use a registry's debian:bookworm\n"
        ), p.stderr
    finally:
        subprocess.run(["rm", "-rf", d])
