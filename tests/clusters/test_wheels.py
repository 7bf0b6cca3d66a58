"""The wheels of `scripts/setup.sh --wheels DIR`, installed elsewhere as a user would.

setup.sh writes Horovod's wheel (from the build cache, which holds this venv's build) and
hvdtrain's. An unprivileged uid with no account and a HOME of its own (setpriv) makes a new
venv at another path and `pip install --no-deps` the two wheels into it; the pinned stack
(TensorFlow, Keras, ...) is this venv's, reached through a directory of links to its
site-packages without horovod and hvdtrain (a .pth file): no compile, no download, and only
the wheels bring Horovod and hvdtrain. From that venv, with no PYTHONPATH and outside the
checkout: the README's 2-rank MNIST job trains to the README's accuracy, Horovod's API probe
(a plain Horovod script) passes under Keras 3, and the doctor lists every patch; after one
patched file is changed, it names that patch.
"""
import glob
import json
import os
import re
import shutil
import sys
import sysconfig

import pytest

from conftest import ROOT, run
from test_setup_sh import as_user, user_tempdir
from hvdtrain.doctor import PATCHES

pytestmark = pytest.mark.timeout(900)  # the first test includes the fixture, a build if uncached
SITE = sysconfig.get_paths()["purelib"]
EXACT = 1e-6


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
    """(uid, directory, user's env, venv) after the wheels are built and installed."""
    uid, d = user_tempdir("hvdtrain-wheels-")
    try:
        wheels = os.path.join(d, "wheels")
        env = dict(os.environ, HVDTRAIN_VENV=sys.prefix, HVDTRAIN_SKIP_APT="1")
        p = run(["bash", os.path.join(ROOT, "scripts", "setup.sh"), "--wheels", wheels], env,
                timeout=900)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        names = sorted(os.path.basename(w) for w in glob.glob(os.path.join(wheels, "*.whl")))
        assert len(names) == 2 and re.fullmatch(
            r"horovod-0\.28\.1\+hvdtrain\.\d+-cp\d+-cp\d+-linux_\w+\.whl", names[0]), names
        assert names[1].startswith("hvdtrain-") and names[1].endswith("-py3-none-any.whl")

        # The locked stack, without horovod and hvdtrain: links into this venv's site-packages.
        stack = os.path.join(d, "stack")
        os.mkdir(stack)
        for name in os.listdir(SITE):
            if not re.match(r"(horovod|hvdtrain|__editable__|_hvdtrain|.*\.pth$)", name, re.I):
                os.symlink(os.path.join(SITE, name), os.path.join(stack, name))
        home, venv = os.path.join(d, "home"), os.path.join(d, "venv")
        os.mkdir(home)
        os.chown(home, uid, uid)
        user_env = {"HOME": home, "USER": "hvdtrain-test", "LANG": "C.UTF-8", "TMPDIR": d,
                    "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin",
                    "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1"}
        base = user_python()
        p = run(as_user(uid, [base, "-m", "venv", venv]), user_env, timeout=120, cwd=d)
        assert p.returncode == 0, p.stderr
        user_site = run(as_user(uid, [f"{venv}/bin/python", "-c",
                                      "import sysconfig; print(sysconfig.get_paths()['purelib'])"]),
                        user_env, timeout=60, cwd=d).stdout.strip()
        with open(os.path.join(user_site, "hvdtrain-stack.pth"), "w") as f:
            f.write(stack + "\n")
        p = run(as_user(uid, [f"{venv}/bin/python", "-m", "pip", "install", "--no-deps",
                              "--no-index", *glob.glob(os.path.join(wheels, "*.whl"))]),
                user_env, timeout=300, cwd=d)
        assert p.returncode == 0, p.stdout + p.stderr
        yield uid, d, user_env, venv, user_site
    finally:
        shutil.rmtree(d)


def user_run(installed, cmd, timeout=240):
    uid, d, env, venv, _ = installed
    return run(as_user(uid, cmd), env, timeout=timeout, cwd=d)


def test_horovod_and_hvdtrain_come_from_the_wheels(installed):
    uid, d, env, venv, site = installed
    p = user_run(installed, ["python", "-c", "import horovod, hvdtrain; from importlib.metadata "
                             "import version; print(horovod.__file__, hvdtrain.__file__, "
                             "version('horovod'))"], timeout=60)
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
    ask = ("import sys; from horovod.runner import launch\n"
           "asked = []\n"
           "def check(verbose): asked.append(1); return 'asked'\n"
           "print(launch._recorded_build(check, 'mpi', False), "
           "launch._recorded_build(check, 'gloo', False), len(asked), "
           "'tensorflow' in sys.modules)")
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


def test_the_readme_mnist_job_trains_to_the_readme_accuracy(installed):
    uid, d, env, venv, _ = installed
    readme = open(os.path.join(ROOT, "README.md")).read()
    accuracy = re.search(r"^Test accuracy: (0\.\d{4})$", readme, re.M).group(1)
    run_dir = os.path.join(d, "mnist")
    p = user_run(installed, ["horovodrun", "-np", "2", "python", "-m", "hvdtrain.mnist",
                             "--run-dir", run_dir])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"Test accuracy: {accuracy}" in p.stdout, p.stdout[-2000:]
    r = json.load(open(os.path.join(run_dir, "result.json")))
    assert (r["world_size"], r["backend"], r["ranks_identical"]) == (2, "horovod", True)
    assert f"{r['test_accuracy']:.4f}" == accuracy


def test_the_horovod_api_probe_passes_under_keras_3(installed):
    uid, d, env, venv, _ = installed
    probe = os.path.join(d, "horovod_api_probe.py")  # a user's script, outside the checkout
    shutil.copy(os.path.join(ROOT, "tests", "horovod_api_probe.py"), probe)
    out = os.path.join(d, "probe")
    os.mkdir(out)
    os.chown(out, uid, uid)
    p = user_run(installed, ["horovodrun", "-np", "2", "--mpi", "python", probe, out])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.load(open(os.path.join(out, "probe.json")))
    assert r["size"] == 2 and r["keras"].startswith("keras")
    probes = {k: v for k, v in r.items() if isinstance(v, dict)}
    assert len(probes) >= 15
    assert {k: v["error"] for k, v in probes.items() if "traceback" in v} == {}
    errs = {f"{k}.{f}": x for k, v in probes.items() for f, x in v.items()
            if f.startswith("err") and isinstance(x, float)}
    assert len(errs) >= 10 and max(errs.values()) < EXACT, errs


def test_the_doctor_lists_every_patch_and_names_a_changed_one(installed):
    uid, d, env, venv, site = installed
    p = user_run(installed, ["python", "-m", "hvdtrain.doctor", "--json"], timeout=120)
    r = json.loads(p.stdout)
    assert p.returncode == 0 and r["ok"] is True, p.stdout
    assert r["horovod"]["patches"] == list(PATCHES) and r["horovod"]["patches_changed"] == {}
    # One patched file changed: the doctor names its patch, and only that one.
    changed = os.path.join(site, "horovod", "tensorflow", "sync_batch_norm.py")
    with open(changed, "a") as f:
        f.write("\n# changed after the build\n")
    p = user_run(installed, ["python", "-m", "hvdtrain.doctor"], timeout=120)
    assert p.returncode == 1, p.stdout
    problems = [l for l in p.stdout.splitlines() if l.startswith("problem:")]
    assert problems == ["problem: horovod's files of patch "
                        "python/horovod-0.28.1-keras3-sync-batch-norm.patch changed since the "
                        "build: horovod/tensorflow/sync_batch_norm.py"], p.stdout
