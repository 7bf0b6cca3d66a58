"""python -m hvdtrain.doctor: this machine passes, with the commands and the report the cluster
guide prints; each known bad combination, made real in a child process, gives exit 1 and
exactly one fix line."""

import ctypes
import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
import sysconfig

import pytest

from conftest import ROOT, clean_env, run
from docs_pages import block

DOCTOR = [sys.executable, "-m", "hvdtrain.doctor"]
# The cluster guide's doctor commands: `python -m hvdtrain.doctor`, then with --json.
GUIDE = block("guides/clusters/index.md", "python -m hvdtrain.doctor").commands()

# A sitecustomize that changes one attribute of a module right after it is first imported,
# so the doctor meets a real installation that differs in exactly that respect. ``value``
# is an expression; ``original`` in it is the attribute it replaces.
PATCH = """import importlib.machinery, sys
{prelude}

class _Patch:
    def find_spec(self, name, path=None, target=None):
        if name != {module!r}:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            original = getattr(module, {attribute!r})
            setattr(module, {attribute!r}, {value})
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Patch())
"""


def has_driver():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def doctor(env, *args):
    p = run([*DOCTOR, *args], env, timeout=120)
    fixes = [l for l in p.stdout.splitlines() if l.startswith("fix:")]
    problems = [l for l in p.stdout.splitlines() if l.startswith("problem:")]
    return p, problems, fixes


def patched(tmp_path, module, attribute, value, prelude=""):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        PATCH.format(module=module, attribute=attribute, value=value, prelude=prelude)
    )
    return clean_env(tmp_path / "home", PYTHONPATH=f"{shim}{os.pathsep}{ROOT}")


def guide_command(line):
    """A documented doctor command as printed: `python` is the one on PATH, this venv's
    (conftest's environment puts its bin first)."""
    words = shlex.split(line)
    assert words[:3] == ["python", "-m", "hvdtrain.doctor"], line
    return words


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The guide's `python -m hvdtrain.doctor --json` on this machine: (process, report)."""
    env = clean_env(tmp_path_factory.mktemp("doctor") / "home")
    assert os.path.samefile(shutil.which("python", path=env["PATH"]), sys.executable)
    assert guide_command(GUIDE[1])[3:] == ["--json"]
    p = run(guide_command(GUIDE[1]), env, timeout=120)
    return p, json.loads(p.stdout) if p.returncode == 0 else None


def test_this_machine_is_well(report):
    p, r = report
    assert p.returncode == 0, p.stdout + p.stderr
    assert r["ok"] is True and r["problems"] == []
    assert r["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert r["tensorflow"]["version"] == "2.21.0"
    # Keras 3 by default: hvdtrain no longer sets TF_USE_LEGACY_KERAS.
    assert r["keras"]["module"] == "keras" and r["keras"]["version"].startswith("3.")
    assert r["keras"]["tf.keras"].startswith("keras") and r["keras"]["TF_USE_LEGACY_KERAS"] is None
    assert r["tf_keras"]["version"].startswith("2.21")
    # the build carries every patch in scripts/patches/ (setup.sh rebuilds when one changes),
    # then those of scripts/patches/python/ (all inside the wheel, applied before it was built)
    patches = os.path.join(ROOT, "scripts", "patches")
    assert r["horovod"]["patches"] == sorted(
        f for f in os.listdir(patches) if f.endswith(".patch")
    ) + [f"python/{f}" for f in sorted(os.listdir(os.path.join(patches, "python")))]
    assert len(r["horovod"]["patches"]) == 15 and r["horovod"]["patches_changed"] == {}
    # the list the doctor checks an installed wheel against, without the repository
    from hvdtrain.doctor import PATCHES

    assert list(PATCHES) == r["horovod"]["patches"]
    assert r["horovod"]["version"] == "0.28.1" and r["horovod"]["frameworks"] == ["tensorflow"]
    # horovodrun --check-build says [X] PyTorch here; setup.sh builds without it.
    assert r["horovod"]["framework_status"]["torch"] == {
        "built": False,
        "installed": importlib.util.find_spec("torch") is not None,
    }
    assert r["horovod"]["framework_status"]["tensorflow"] == {"built": True, "installed": True}
    assert r["horovod"]["built"]["mpi"] is True and r["horovod"]["built"]["gloo"] is True
    assert set(r["horovod"]["built"]) == {"mpi", "gloo", "nccl", "ddl", "ccl", "cuda", "rocm"}
    assert r["mpi"]["library"].startswith("Open MPI v4.1")
    assert isinstance(r["gpus"], list)
    assert all(os.access(r["launchers"][n], os.X_OK) for n in ("horovodrun", "mpirun"))
    # glibc and THP as this machine has them; run by hand (no launcher), it did not re-execute
    from hvdtrain.base import malloc

    h = r["hugepages"]
    assert h["glibc"] == os.confstr("CS_GNU_LIBC_VERSION").split()[1]
    assert f"[{h['thp']}]" in open(malloc.THP).read()
    assert h["unavailable"] is None  # Debian 12's glibc 2.36, THP madvise: what CI runs on
    assert h["ranks_get"] == "glibc.malloc.hugetlb=1" and h["environment"] is None
    assert h["this_process"] is None and h["this_process_has"] is False


def test_the_doctor_as_a_launched_rank_started_with_huge_pages(tmp_path):
    """A process a launcher started (its size variable set) re-executes itself with the
    tunable before the doctor runs: the doctor sees it in what its process started with."""
    env = clean_env(
        tmp_path / "home", OMPI_COMM_WORLD_SIZE="2", GLIBC_TUNABLES="glibc.malloc.arena_max=4"
    )
    p = run([*DOCTOR, "--json"], env, timeout=120)
    h = json.loads(p.stdout)["hugepages"]
    assert h["this_process"] == "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"
    assert h["this_process_has"] is True and h["ranks_get"] is None


# The report's lines whose values are this machine's own: Python's version and path, the MPI
# library's version string, the launchers' paths, glibc's version. The guide's sample shows
# them for a checkout at /home/me/hvdtrain.
MACHINE = ("python", "mpi", "launchers", "hugepages")
SAMPLE_VENV = "/home/me/hvdtrain/.venv"


def label(line):
    return line[:14].strip()  # doctor._line: two spaces, the name in 11 columns, a space


def test_text_report(env):
    """The guide's `python -m hvdtrain.doctor` as printed: exit 0, and the report of its
    sample: the same lines in the same order, equal to the character but for this machine's
    own values, which must have the sample's form (only digits and the venv's path differ)."""
    p = run(guide_command(GUIDE[0]), env, timeout=120)
    out = p.stdout.splitlines()
    assert p.returncode == 0, p.stdout + p.stderr
    assert not [l for l in out if l.startswith(("problem:", "fix:"))], p.stdout
    assert out[-1] == "all good"
    assert any(l.split()[:2] == ["tensorflow", "2.21.0"] for l in out)
    assert any(l.split()[:2] == ["keras", "keras"] and l.split()[2].startswith("3.") for l in out)
    assert any(
        "hvdtrain patches: horovod-0.28.1-gcc14.patch, "
        "horovod-0.28.1-gpu-stream-handle.patch, "
        "horovod-0.28.1-launch-without-tensorflow.patch, "
        "horovod-0.28.1-no-xla-ops.patch" in l
        for l in out
    )
    assert any("controllers MPI, Gloo" in l for l in out)
    assert any(
        l.split()[:2] == ["horovod", "0.28.1:"]
        and "frameworks tensorflow (PyTorch not built into horovod, MXNet not built into horovod);"
        in l
        for l in out
    )
    if not has_driver():  # no NVIDIA driver: one line says so, not TensorFlow's cuInit errors
        assert [l for l in out if "gpus" in l.split()[:1]] == [
            "  gpus        none visible: no NVIDIA driver (libcuda.so.1 not found)"
        ]
        assert "cuInit" not in p.stdout + p.stderr

    sample = block("guides/clusters/index.md", "  python ").text.splitlines()
    venv = os.path.dirname(os.path.dirname(sys.executable))

    def form(line):
        return re.sub(r"\d+", "N", line.replace(venv, "VENV").replace(SAMPLE_VENV, "VENV"))

    assert [label(l) for l in out] == [label(l) for l in sample], (out, sample)
    for got, shown in zip(out, sample):
        if label(got) in MACHINE:
            assert form(got) == form(shown), (got, shown)
        elif label(got) != "gpus" or not has_driver():  # a driver: the GPUs of this machine
            assert got == shown


def test_the_gpu_build_sample_is_what_the_doctor_prints_for_it(report, monkeypatch):
    """The guide's report of CI's GPU build on a machine without a GPU is what the doctor's
    render prints for this machine's Horovod built as setup.sh builds it for GPUs: NCCL and
    CUDA in, kernels by the nvcc setup.sh pins for setup.sh's default architectures (PTX for
    the newest, as Horovod's CMake compiles them), TensorFlow's own CUDA version (its
    build_info), the CUDA runtime and NCCL that scripts/test_gpu_build.sh (CI's GPU build)
    requires the doctor to report, and no driver."""
    from hvdtrain import doctor as D
    from hvdtrain import doctor_probes

    p, r = report
    assert r is not None, p.stdout + p.stderr
    sample = block("guides/clusters/index.md", "  horovod ").text.splitlines()
    text = "\n".join(sample)
    ci = open(os.path.join(ROOT, "scripts", "test_gpu_build.sh")).read()
    expect = re.findall(r'"([^"]+)"', re.search(r"^expect=\((.*?)\)$", ci, re.M | re.S).group(1))
    assert len(expect) == 4 and all(e in text for e in expect), expect
    setup = open(os.path.join(ROOT, "scripts", "setup.sh")).read()
    nvcc = re.search(r"nvidia-cuda-nvcc==((\d+\.\d+)\.\d+)", setup)
    archs = re.search(r"HOROVOD_BUILD_CUDA_CC_LIST:-([\d,]+)\}", setup).group(1).split(",")
    tf_dir = importlib.util.find_spec("tensorflow").submodule_search_locations[0]
    build_info = open(os.path.join(tf_dir, "python", "platform", "build_info.py")).read()
    runtime, nccl = re.search(r"CUDA runtime (\S+) .*, NCCL (\S+) \(", text).groups()

    def no_driver(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(doctor_probes.ctypes, "CDLL", no_driver)
    horovod = dict(
        r["horovod"],
        built=dict(r["horovod"]["built"], nccl=True, cuda=True),
        gpu_build={
            "cuda_runtime_wheel": runtime,
            "nccl": nccl,
            "nccl_built": nccl,
            "cuda_runtime": re.search(r"'cuda_version', '([\d.]+)'", build_info).group(1),
            "compiler": f"release {nvcc.group(2)}, V{nvcc.group(1)}",
            "cubin": [f"sm_{a}" for a in archs],
            "ptx": [f"sm_{archs[-1]}"],
        },
    )
    gpu = dict(r, horovod=horovod, gpus=[], driver=None, no_gpu=D.cuda_driver()[1])
    shown = {label(l) for l in sample}
    assert [l for l in D.render(gpu, []).splitlines() if label(l) in shown] == sample


def test_a_framework_counts_only_when_built_and_installed(tmp_path):
    """horovod/torch/ with Horovod's Python files alone is what --check-build marks [X]."""
    from hvdtrain.doctor import frameworks

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for sub in ("tensorflow", "torch", "mxnet"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "__init__.py").write_text("")
    (tmp_path / "tensorflow" / f"mpi_lib{suffix}").write_bytes(b"")
    (tmp_path / "torch" / f"mpi_lib{suffix}").write_bytes(b"")  # torch's is mpi_lib_v2
    status = frameworks(str(tmp_path))
    assert [status[s]["built"] for s in ("tensorflow", "torch", "mxnet")] == [True, False, False]
    (tmp_path / "torch" / f"mpi_lib_v2{suffix}").write_bytes(b"")
    assert frameworks(str(tmp_path))["torch"]["built"] is True
    assert status["tensorflow"]["installed"] is True


def test_the_venv_launchers_count_without_path(tmp_path):
    env = clean_env(tmp_path / "home")
    env["PATH"] = "/usr/bin:/bin"  # mpirun is here; horovodrun only in the venv's bin
    p, problems, fixes = doctor(env, "--json")
    assert p.returncode == 0, p.stdout
    assert json.loads(p.stdout)["launchers"]["horovodrun"] == os.path.join(
        os.path.dirname(sys.executable), "horovodrun"
    )


def test_horovod_missing(tmp_path):
    shim = tmp_path / "shim" / "horovod"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'horovod'\")\n")
    env = clean_env(tmp_path / "home", PYTHONPATH=f"{shim.parent}{os.pathsep}{ROOT}")
    p, problems, fixes = doctor(env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert len(problems) == 1 and "horovod is not installed" in problems[0]
    assert len(fixes) == 1 and "scripts/setup.sh" in fixes[0] and "HOROVOD_WITH_MPI=1" in fixes[0]
    r = json.loads(doctor(env, "--json")[0].stdout)
    assert r["ok"] is False and r["horovod"]["version"] is None


def test_without_mpi4py_the_mpi_line_is_mpiruns(tmp_path):
    """An environment with the wheels alone has no mpi4py: the MPI line is what the mpirun
    that starts the ranks says of itself (`mpirun --version`), not "unknown"."""
    shim = tmp_path / "shim" / "mpi4py"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mpi4py'\")\n")
    env = clean_env(tmp_path / "home", PYTHONPATH=f"{shim.parent}{os.pathsep}{ROOT}")
    p, problems, fixes = doctor(env, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(p.stdout)
    said = run([shutil.which("mpirun"), "--version"], env, timeout=60).stdout.splitlines()[0]
    assert r["mpi"]["library"] == said and said.startswith("mpirun (Open MPI) 4.1"), r["mpi"]
    assert "mpi4py" in r["mpi"]["error"]
    p, problems, fixes = doctor(env)
    assert "  " + "mpi".ljust(11) + " " + said in p.stdout.splitlines(), p.stdout


def test_horovod_built_without_mpi(tmp_path):
    env = patched(tmp_path, "horovod.tensorflow", "mpi_built", "lambda: False")
    p, problems, fixes = doctor(env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert problems == ["problem: horovod 0.28.1 was built without MPI"]
    assert len(fixes) == 1 and "scripts/setup.sh" in fixes[0]
    assert "pip uninstall -y horovod" in fixes[0]  # also for a horovod installed by hand
    assert "controllers Gloo;" in p.stdout


def test_horovod_tensorflow_does_not_load(tmp_path):
    """A horovod compiled against another TensorFlow: TensorFlow cannot load its op library."""
    prelude = (
        "def refuse_horovod(original):\n"
        "    def load_op_library(filename):\n"
        "        if 'horovod' in filename:\n"
        "            raise RuntimeError(filename + ': undefined symbol: '\n"
        "                               '_ZN10tensorflow8OpKernel11TraceStringB5cxx11')\n"
        "        return original(filename)\n"
        "    return load_op_library\n"
    )
    env = patched(
        tmp_path,
        "tensorflow.python.framework.load_library",
        "load_op_library",
        "refuse_horovod(original)",
        prelude,
    )
    p, problems, fixes = doctor(env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert len(problems) == 1 and "horovod.tensorflow cannot be imported" in problems[0]
    assert "undefined symbol" in problems[0] and "mpi_lib" in problems[0]
    assert len(fixes) == 1 and "scripts/setup.sh" in fixes[0]


def test_keras_2_when_asked(tmp_path):
    env = clean_env(tmp_path / "home", TF_USE_LEGACY_KERAS="1")
    p, problems, fixes = doctor(env, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(p.stdout)
    assert r["keras"]["module"] == "tf_keras" and r["keras"]["version"].startswith("2.21")
    assert r["keras"]["tf.keras"].startswith("tf_keras")


def test_keras_backend_not_tensorflow(tmp_path):
    env = clean_env(tmp_path / "home", KERAS_BACKEND="jax")  # jax is not installed here
    p, problems, fixes = doctor(env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert len(problems) == 1 and "KERAS_BACKEND" in problems[0], problems
    assert len(fixes) == 1 and "unset KERAS_BACKEND" in fixes[0]


def test_tf_keras_of_another_release(tmp_path):
    """Keras 2 asked for, but tf_keras is not TensorFlow's release (a pip install by hand)."""
    env = patched(
        tmp_path,
        "importlib.metadata",
        "version",
        "lambda d: '2.18.0' if d == 'tf_keras' else original(d)",
    )
    env["TF_USE_LEGACY_KERAS"] = "1"
    p, problems, fixes = doctor(env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert problems == [
        "problem: TF_USE_LEGACY_KERAS=1 with tf_keras 2.18.0 on TensorFlow "
        "2.21.0: tf_keras must be the same release as TensorFlow"
    ]
    assert fixes == ["fix: pip install tf-keras==2.21.* (or scripts/setup.sh)"]


def test_keras_2_asked_but_tf_keras_missing(tmp_path):
    shim = tmp_path / "shim" / "tf_keras"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'tf_keras'\")\n")
    env = clean_env(
        tmp_path / "home", PYTHONPATH=f"{shim.parent}{os.pathsep}{ROOT}", TF_USE_LEGACY_KERAS="1"
    )
    p, problems, fixes = doctor(env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert len(problems) == 1 and "tf_keras does not import" in problems[0]
    assert len(fixes) == 1 and "scripts/setup.sh" in fixes[0]


def test_doctor_does_not_import_horovod_into_hvdtrain(env):
    """Only hvdtrain.distributed imports horovod, and only when training starts."""
    code = (
        "import sys, hvdtrain, hvdtrain.doctor, hvdtrain.linear, hvdtrain.mnist\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('horovod', 'tensorflow', 'mpi4py')))\n"
    )
    p = run([sys.executable, "-c", code], env, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr
