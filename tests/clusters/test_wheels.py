"""The wheels of `scripts/setup.sh --wheels DIR`, installed elsewhere as a user would, with the
install guide's commands (docs/guides/install.md: a cluster without root, an existing
environment, the image snippet) and the README's and getting-started page's.

setup.sh writes Horovod's wheel and hvdtrain's, as the guide's cluster block runs it, with
HVDTRAIN_BUILD_CACHE's entry for this build damaged (one byte of its wheel changed): it is not
installed but removed, and the wheel comes from the user's own cache (a build there otherwise). An unprivileged uid with no account and a
HOME of its own (setpriv) makes a new venv at another path (the guide's `python3.X -m venv`)
and installs the two wheels into it as the guide's "existing environment" does, `pip install
--no-deps DIR/*.whl`, then runs the guide's `pip install -c DIR/constraints.txt DIR/*.whl`
(with --no-index: no network here), which must find the whole locked stack already there. The
pinned stack (TensorFlow, Keras, ...) is this venv's, reached through a directory of links to
its site-packages without horovod and hvdtrain (a .pth file): no compile, no download, and
only the wheels bring Horovod and hvdtrain. From that venv, with no PYTHONPATH and outside the
checkout: the getting-started page's 2-rank MNIST job trains to the README's accuracy, and
the doctor (activated as the README says) lists every patch, each patched file as built;
after one patched file is changed, it names that patch. Horovod's API probe runs from the
development venv instead (tests/runs/test_horovod_api.py): setup.sh installs this same wheel
there, and checks every installed file against the wheel's RECORD.
"""

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

import pytest
from test_setup_faults import installed_entry
from test_setup_sh import as_user, user_tempdir

from conftest import ROOT, run
from docs_pages import block
from hvdtrain.doctor import PATCHES

pytestmark = pytest.mark.timeout(900)  # the first test includes the fixture, a build if uncached
SITE = sysconfig.get_paths()["purelib"]
# A cluster without root: module load; setup.sh --wheels ~/hvdtrain-wheels; a venv on a shared
# directory; pip install -c the lock and the wheels into it; its doctor.
CLUSTER = block("guides/install.md", "module load gcc cmake openmpi").commands()
# An existing environment: pip install --no-deps DIR/*.whl; the doctor.
EXISTING = block("guides/install.md", "pip install --no-deps DIR/*.whl").commands()
# Root on Debian: setup.sh, source .venv/bin/activate, the doctor, the optional dataset; the
# README's first three lines, and the getting-started page's setup.sh && a 2-rank MNIST job.
ROOT_INSTALL = block("guides/install.md", "scripts/setup.sh ").commands()
README = block("README.md", "scripts/setup.sh\nsource .venv/bin/activate").commands()
GETTING_STARTED = block("getting-started.md", "scripts/setup.sh && PATH=").commands()
# An image of one's own: COPY the wheels in, RUN pip install -c the lock and the wheels.
IMAGE = block("guides/install.md", "COPY hvdtrain-wheels/ /tmp/wheels/").text.splitlines()


def guide_line(line, wheels, venv):
    """A line of the install guide with this test's paths for its wheel directory and venv."""
    for printed, here in (
        ("~/hvdtrain-wheels", wheels),
        ("DIR", wheels),
        ("/shared/envs/hvdtrain", venv),
    ):
        line = line.replace(printed, here)
    return line


def dists(site):
    return {n for n in os.listdir(site) if n.endswith(".dist-info")}


def test_the_install_blocks_are_one_set_up():
    """The README's and the getting-started page's set-up is the guide's root block: setup.sh
    (which the fixture below runs, as the cluster block does, with --wheels), the venv
    activated, the doctor; the existing environment's and the cluster's doctor are the same
    command; the image snippet installs what the cluster block installs, from a copy of the
    same wheel directory. The cluster block's `module load` cannot run here (no environment
    modules): the modules it loads are the tools setup.sh checks for, by the names its
    messages give."""
    assert README == ROOT_INSTALL[:3]
    setup, _, job = GETTING_STARTED[0].partition(" && ")
    assert setup == ROOT_INSTALL[0] == "scripts/setup.sh" and job
    words = shlex.split(CLUSTER[1])
    assert [w for w in words if "=" not in w][:2] == [ROOT_INSTALL[0], "--wheels"], words
    assert ROOT_INSTALL[1:3] == ["source .venv/bin/activate", EXISTING[1]]
    assert CLUSTER[4] == f"/shared/envs/hvdtrain/bin/{EXISTING[1]}"
    # The modules: a compiler, cmake and an MPI, the build tools setup.sh looks for on PATH
    # (the site's module names; the comment names the MPI's commands).
    module, load, *modules = shlex.split(CLUSTER[0])
    setup_sh = open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    assert (module, load, modules) == ("module", "load", ["gcc", "cmake", "openmpi"]), CLUSTER[0]
    for looks_for in (
        "command -v c++ || command -v g++",
        "command -v cmake",
        "command -v mpicxx",
        "command -v mpirun",
    ):
        assert looks_for in setup_sh, looks_for
    assert re.search(
        r"module load .*# the site's names: mpicxx and mpirun on PATH",
        block("guides/install.md", "module load gcc cmake openmpi").text,
    )
    copy, run_line = IMAGE
    (source, target) = re.fullmatch(r"COPY (\S+)/ (\S+)/", copy).groups()
    assert source == os.path.basename(words[-1]), (source, words)
    pip = guide_line(CLUSTER[3], target, "VENV")
    assert pip.startswith("VENV/bin/pip install "), CLUSTER[3]
    assert run_line == f"RUN {pip[len('VENV/bin/') :]} && rm -rf {target}", run_line


@pytest.mark.skipif(
    subprocess.run(["dpkg-query", "-W", "dataset-fashion-mnist"], capture_output=True).returncode
    != 0,
    reason="dataset-fashion-mnist not installed (not in every distribution)",
)
def test_the_optional_dataset_package_is_where_hvdtrain_reads():
    """The root block's optional `apt-get install dataset-fashion-mnist`: the package holds
    the IDX files hvdtrain reads for --dataset fashion_mnist, where it reads them."""
    from hvdtrain.inputs.loaders import FASHION_SYSTEM_DIR, IDX_FILES

    apt, install, package = shlex.split(ROOT_INSTALL[3])
    assert (apt, install) == ("apt-get", "install")
    files = subprocess.run(
        ["dpkg", "-L", package], capture_output=True, text=True, timeout=30
    ).stdout.split()
    assert {
        os.path.join(FASHION_SYSTEM_DIR, f) for split in IDX_FILES.values() for f in split
    } <= set(files)


def user_python():
    """An interpreter of this Python's minor version that another user can run: the system's
    (this venv's may live in root's home, e.g. pyenv's), else this venv's own base."""
    minor = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for p in (f"/usr/bin/{minor}", f"/usr/local/bin/{minor}"):
        if os.access(p, os.X_OK):
            return p
    return getattr(sys, "_base_executable", sys.executable)


@pytest.fixture(scope="module")
def installed():
    """(uid, directory, user's env, venv, its site-packages) after the guide's cluster block
    built the wheels and made the venv, and its existing-environment block installed them."""
    uid, d = user_tempdir("hvdtrain-wheels-")
    try:
        # The guide's `PYTHON=python3.X scripts/setup.sh --wheels ~/hvdtrain-wheels`, here on
        # this venv (whose Python it keeps), without apt.
        wheels, venv = os.path.join(d, "hvdtrain-wheels"), os.path.join(d, ".venv")
        *assignments, script, flag, directory = shlex.split(guide_line(CLUSTER[1], wheels, venv))
        assert (script, flag, directory) == ("scripts/setup.sh", "--wheels", wheels)
        # HVDTRAIN_BUILD_CACHE: a copy of the entry this venv's Horovod came from, with one
        # byte of its wheel changed. setup.sh must not install it, but remove it and go on to
        # the next place it looks, the user's own cache (~/.cache/hvdtrain), where the good
        # entry is (CI's set-up put it there): no compile.
        cache = os.path.join(d, "cache")
        good = installed_entry()
        entry = os.path.join(cache, os.path.basename(good))
        shutil.copytree(good, entry)
        (damaged,) = glob.glob(os.path.join(entry, "horovod-*.whl"))
        with open(damaged, "r+b") as f:
            f.seek(os.path.getsize(damaged) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
        env = dict(
            os.environ,
            HVDTRAIN_VENV=sys.prefix,
            HVDTRAIN_SKIP_APT="1",
            HVDTRAIN_BUILD_CACHE=cache,
            **dict(a.split("=", 1) for a in assignments),
        )
        p = run(["bash", os.path.join(ROOT, script), flag, directory], env, timeout=900)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        lines = p.stdout.splitlines()
        assert (
            f"[setup] the build cache's {entry} does not match its SHA256SUMS (changed or "
            "damaged): removed, not installed"
        ) in lines, p.stdout
        assert not os.path.exists(entry) and "compiling horovod" not in p.stdout, p.stdout
        assert f"[setup] the horovod wheel from the build cache: {good}" in lines, p.stdout
        names = sorted(os.path.basename(w) for w in glob.glob(os.path.join(wheels, "*.whl")))
        assert len(names) == 2 and re.fullmatch(
            r"horovod-0\.28\.1\+hvdtrain\.\d+-cp\d+-cp\d+-linux_\w+\.whl", names[0]
        ), names
        assert names[1].startswith("hvdtrain-") and names[1].endswith("-py3-none-any.whl")
        assert os.path.exists(os.path.join(wheels, "constraints.txt"))

        # The locked stack, without horovod and hvdtrain: links into this venv's site-packages.
        stack = os.path.join(d, "stack")
        os.mkdir(stack)
        for name in os.listdir(SITE):
            if not re.match(r"(horovod|hvdtrain|__editable__|_hvdtrain|.*\.pth$)", name, re.I):
                os.symlink(os.path.join(SITE, name), os.path.join(stack, name))
        home = os.path.join(d, "home")
        os.mkdir(home)
        os.chown(home, uid, uid)
        user_env = {
            "HOME": home,
            "USER": "hvdtrain-test",
            "LANG": "C.UTF-8",
            "TMPDIR": d,
            "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin",
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONUNBUFFERED": "1",
        }
        # The guide's `python3.X -m venv /shared/envs/hvdtrain` (this Python's minor version).
        python, *make = shlex.split(guide_line(CLUSTER[2], wheels, venv))
        assert re.fullmatch(r"python3\.\d+", python) and make == ["-m", "venv", venv], CLUSTER[2]
        p = run(as_user(uid, [user_python(), *make]), user_env, timeout=120, cwd=d)
        assert p.returncode == 0, p.stderr
        user_site = run(
            as_user(
                uid,
                [
                    f"{venv}/bin/python",
                    "-c",
                    "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                ],
            ),
            user_env,
            timeout=60,
            cwd=d,
        ).stdout.strip()
        with open(os.path.join(user_site, "hvdtrain-stack.pth"), "w") as f:
            f.write(stack + "\n")
        # An environment that holds TensorFlow: the guide's `pip install --no-deps DIR/*.whl`,
        # with its pip (the venv's bin first on PATH), "Horovod and hvdtrain, nothing else".
        before = dists(user_site)
        p = run(
            as_user(uid, ["bash", "-c", guide_line(EXISTING[0], wheels, venv)]),
            user_env,
            timeout=300,
            cwd=d,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        assert sorted(n.split("-")[0] for n in dists(user_site) - before) == [
            "horovod",
            "hvdtrain",
        ] and before <= dists(user_site)
        # The cluster block's `pip install -c DIR/constraints.txt DIR/*.whl` (the image
        # snippet's too): with --no-index, it must find the locked stack and the wheels there,
        # and install nothing.
        p = run(
            as_user(uid, ["bash", "-c", guide_line(CLUSTER[3], wheels, venv) + " --no-index"]),
            user_env,
            timeout=300,
            cwd=d,
        )
        assert p.returncode == 0 and "Successfully installed" not in p.stdout, p.stdout + p.stderr
        yield uid, d, user_env, venv, user_site
    finally:
        shutil.rmtree(d)


def user_run(installed, cmd, timeout=240):
    uid, d, env, venv, _ = installed
    return run(as_user(uid, cmd), env, timeout=timeout, cwd=d)


def test_horovod_and_hvdtrain_come_from_the_wheels(installed):
    uid, d, env, venv, site = installed
    p = user_run(
        installed,
        [
            "python",
            "-c",
            "import horovod, hvdtrain; from importlib.metadata "
            "import version; print(horovod.__file__, hvdtrain.__file__, "
            "version('horovod'))",
        ],
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    hvd_file, hvdtrain_file, version = p.stdout.split()
    assert hvd_file.startswith(site) and hvdtrain_file.startswith(site)
    assert re.fullmatch(r"0\.28\.1\+hvdtrain\.\d+", version)
    # Installed by the user, not by root.
    assert os.stat(hvd_file).st_uid == uid


def test_horovodrun_takes_the_build_record_from_the_wheel(installed):
    """The wheel's hvdtrain_built.json answers horovodrun's "built with MPI/Gloo?" without
    importing TensorFlow, while it names the installed op library; a record naming another
    library is not believed (the extension is asked, as without the record)."""
    uid, d, env, venv, site = installed
    ask = (
        "import sys; from horovod.runner import launch\n"
        "asked = []\n"
        "def check(verbose): asked.append(1); return 'asked'\n"
        "print(launch._recorded_build(check, 'mpi', False), "
        "launch._recorded_build(check, 'gloo', False), len(asked), "
        "'tensorflow' in sys.modules)"
    )
    p = user_run(installed, ["python", "-c", ask], timeout=60)
    assert (p.returncode, p.stdout.split()) == (0, ["True", "True", "0", "False"]), p.stderr
    path = os.path.join(site, "horovod", "hvdtrain_built.json")
    record = json.load(open(path))
    assert record["tensorflow"] == "2.21.0" and record["nccl"] is False
    original = open(path).read()
    try:
        with open(path, "w") as f:
            json.dump(dict(record, library=[*record["library"][:2], record["library"][2] + 1]), f)
        p = user_run(installed, ["python", "-c", ask], timeout=60)
        assert (p.returncode, p.stdout.split()) == (0, ["asked", "asked", "2", "False"]), p.stderr
    finally:
        with open(path, "w") as f:
            f.write(original)


def test_the_getting_started_mnist_job_trains_to_the_readme_accuracy(installed):
    """The getting-started page's job after setup.sh, as printed, where .venv is (the
    command puts its bin on PATH): two ranks, the README's accuracy, its run directory under
    runs/."""
    uid, d, env, venv, _ = installed
    readme = open(os.path.join(ROOT, "README.md")).read()
    accuracy = re.search(r"^Test accuracy: (0\.\d{4})$", readme, re.M).group(1)
    job = GETTING_STARTED[0].partition(" && ")[2]
    assert job.startswith("PATH=$PWD/.venv/bin:$PATH ") and venv == os.path.join(d, ".venv")
    p = run(
        as_user(uid, ["bash", "-c", job]),
        dict(env, PATH="/usr/local/bin:/usr/bin:/bin"),
        timeout=240,
        cwd=d,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"Test accuracy: {accuracy}" in p.stdout, p.stdout[-2000:]
    (run_dir,) = glob.glob(os.path.join(d, "runs", "mnist-*"))
    r = json.load(open(os.path.join(run_dir, "result.json")))
    assert (r["world_size"], r["backend"], r["ranks_identical"]) == (2, "horovod", True)
    assert f"{r['test_accuracy']:.4f}" == accuracy


def test_the_doctor_lists_every_patch_and_names_a_changed_one(installed):
    """The README's `source .venv/bin/activate` and doctor, as printed where .venv is: all
    good, every patch listed. One patched file changed: the cluster block's doctor (the venv's
    python) names its patch, and only that one."""
    uid, d, env, venv, site = installed
    p = run(
        as_user(uid, ["bash", "-c", "\n".join(README[1:])]),
        dict(env, PATH="/usr/local/bin:/usr/bin:/bin"),
        timeout=120,
        cwd=d,
    )
    out = p.stdout.splitlines()
    assert p.returncode == 0 and out[-1] == "all good", p.stdout + p.stderr
    (horovod,) = [l for l in out if l.split()[:1] == ["horovod"]]
    assert horovod.split("; hvdtrain patches: ")[1].split(", ") == list(PATCHES), horovod
    assert f"({venv}/bin/python)" in out[0]  # the activated venv's
    changed = os.path.join(site, "horovod", "tensorflow", "sync_batch_norm.py")
    with open(changed, "a") as f:
        f.write("\n# changed after the build\n")
    p = user_run(installed, shlex.split(guide_line(CLUSTER[4], "", venv)), timeout=120)
    assert p.returncode == 1, p.stdout
    problems = [l for l in p.stdout.splitlines() if l.startswith("problem:")]
    assert problems == [
        "problem: horovod's files of patch "
        "python/horovod-0.28.1-keras3-sync-batch-norm.patch changed since the "
        "build: horovod/tensorflow/sync_batch_norm.py"
    ], p.stdout


def test_another_tensorflow_is_named_by_the_doctor_horovodrun_and_hvdtrain(installed):
    """The wheels installed beside another TensorFlow release (its metadata says 2.20.0: a
    directory on PYTHONPATH holding tensorflow-2.20.0.dist-info): the doctor, horovodrun and
    a 2-rank job under mpirun each say in one line that horovod was built against 2.21.0, and
    the fix, instead of an undefined symbol or "Neither MPI nor Gloo support has been built"."""
    uid, d, env, venv, site = installed
    other = os.path.join(d, "tensorflow-2.20")
    info = os.path.join(other, "tensorflow-2.20.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: tensorflow\nVersion: 2.20.0\n")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("")
    env = dict(env, PYTHONPATH=other)
    what = (
        "horovod 0.28.1+hvdtrain.1 was built against TensorFlow 2.21.0, but this environment "
        "has TensorFlow 2.20.0"
    )
    fix = (
        "pip install tensorflow==2.21.0 (the version the wheel needs), or pip uninstall -y "
        "horovod && scripts/setup.sh (a build against 2.20.0)"
    )
    p = run(as_user(uid, ["python", "-m", "hvdtrain.doctor"]), env, timeout=120, cwd=d)
    assert p.returncode == 1, p.stdout + p.stderr
    problems = [l for l in p.stdout.splitlines() if l.startswith(("problem:", "fix:"))]
    assert problems == [f"problem: {what}", f"fix: {fix}"], p.stdout
    p = run(
        as_user(uid, ["horovodrun", "-np", "2", "python", "-c", "pass"]), env, timeout=120, cwd=d
    )
    # As the install guide prints it.
    said = block("guides/install.md", "horovodrun: error: horovod ").text.strip()
    assert said == f"horovodrun: error: {what}: {fix}"
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == said, p.stdout + p.stderr
    p = run(
        as_user(
            uid,
            [
                "mpirun",
                "-np",
                "2",
                "-x",
                "PYTHONPATH",
                "python",
                "-m",
                "hvdtrain.linear",
                "--epochs",
                "1",
            ],
        ),
        env,
        timeout=180,
        cwd=d,
    )
    assert p.returncode != 0, p.stdout + p.stderr
    assert (
        f"python -m hvdtrain.linear: error: horovod cannot be imported ({what}: {fix}), "
        "but a launcher started 2 processes: refusing to train 2 independent copies"
        in p.stderr.splitlines()
    ), p.stderr
    assert "undefined symbol" not in p.stderr and "Traceback" not in p.stderr, p.stderr
