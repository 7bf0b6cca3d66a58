"""python -m hvdtrain.doctor: this machine passes; each known bad combination, made real in
a child process, gives exit 1 and exactly one fix line."""
import ctypes
import importlib.util
import json
import os
import sys
import sysconfig


from conftest import ROOT, clean_env, run

DOCTOR = [sys.executable, "-m", "hvdtrain.doctor"]

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
    (shim / "sitecustomize.py").write_text(PATCH.format(module=module, attribute=attribute,
                                                        value=value, prelude=prelude))
    return clean_env(tmp_path / "home", PYTHONPATH=f"{shim}{os.pathsep}{ROOT}")


def test_this_machine_is_well(env):
    p, problems, fixes = doctor(env, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(p.stdout)
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
    assert r["horovod"]["patches"] == sorted(f for f in os.listdir(patches) if f.endswith(".patch")) + [
        f"python/{f}" for f in sorted(os.listdir(os.path.join(patches, "python")))]
    assert len(r["horovod"]["patches"]) == 10 and r["horovod"]["patches_changed"] == {}
    # the list the doctor checks an installed wheel against, without the repository
    from hvdtrain.doctor import PATCHES
    assert list(PATCHES) == r["horovod"]["patches"]
    assert r["horovod"]["version"] == "0.28.1" and r["horovod"]["frameworks"] == ["tensorflow"]
    # horovodrun --check-build says [X] PyTorch here; setup.sh builds without it.
    assert r["horovod"]["framework_status"]["torch"] == {
        "built": False, "installed": importlib.util.find_spec("torch") is not None}
    assert r["horovod"]["framework_status"]["tensorflow"] == {"built": True, "installed": True}
    assert r["horovod"]["built"]["mpi"] is True and r["horovod"]["built"]["gloo"] is True
    assert set(r["horovod"]["built"]) == {"mpi", "gloo", "nccl", "ddl", "ccl", "cuda", "rocm"}
    assert r["mpi"]["library"].startswith("Open MPI v4.1")
    assert isinstance(r["gpus"], list)
    assert all(os.access(r["launchers"][n], os.X_OK) for n in ("horovodrun", "mpirun"))


def test_text_report(env):
    p, problems, fixes = doctor(env)
    assert p.returncode == 0 and (problems, fixes) == ([], [])
    out = p.stdout.splitlines()
    assert out[-1] == "all good"
    assert any(l.split()[:2] == ["tensorflow", "2.21.0"] for l in out)
    assert any(l.split()[:2] == ["keras", "keras"] and l.split()[2].startswith("3.") for l in out)
    assert any("hvdtrain patches: horovod-0.28.1-gcc14.patch, "
               "horovod-0.28.1-gpu-stream-handle.patch, "
               "horovod-0.28.1-launch-without-tensorflow.patch, "
               "horovod-0.28.1-no-xla-ops.patch" in l for l in out)
    assert any("controllers MPI, Gloo" in l for l in out)
    assert any(l.split()[:2] == ["horovod", "0.28.1:"] and "frameworks tensorflow (PyTorch not "
               "built into horovod, MXNet not built into horovod);" in l for l in out)
    if not has_driver():  # no NVIDIA driver: one line says so, not TensorFlow's cuInit errors
        assert [l for l in out if "gpus" in l.split()[:1]] == [
            "  gpus        none visible: no NVIDIA driver (libcuda.so.1 not found)"]
        assert "cuInit" not in p.stdout + p.stderr


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
        os.path.dirname(sys.executable), "horovodrun")


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
    prelude = ("def refuse_horovod(original):\n"
               "    def load_op_library(filename):\n"
               "        if 'horovod' in filename:\n"
               "            raise RuntimeError(filename + ': undefined symbol: '\n"
               "                               '_ZN10tensorflow8OpKernel11TraceStringB5cxx11')\n"
               "        return original(filename)\n"
               "    return load_op_library\n")
    env = patched(tmp_path, "tensorflow.python.framework.load_library", "load_op_library",
                  "refuse_horovod(original)", prelude)
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
    env = patched(tmp_path, "importlib.metadata", "version",
                  "lambda d: '2.18.0' if d == 'tf_keras' else original(d)")
    env["TF_USE_LEGACY_KERAS"] = "1"
    p, problems, fixes = doctor(env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert problems == ["problem: TF_USE_LEGACY_KERAS=1 with tf_keras 2.18.0 on TensorFlow "
                        "2.21.0: tf_keras must be the same release as TensorFlow"]
    assert fixes == ["fix: pip install tf-keras==2.21.* (or scripts/setup.sh)"]


def test_keras_2_asked_but_tf_keras_missing(tmp_path):
    shim = tmp_path / "shim" / "tf_keras"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'tf_keras'\")\n")
    env = clean_env(tmp_path / "home", PYTHONPATH=f"{shim.parent}{os.pathsep}{ROOT}",
                    TF_USE_LEGACY_KERAS="1")
    p, problems, fixes = doctor(env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert len(problems) == 1 and "tf_keras does not import" in problems[0]
    assert len(fixes) == 1 and "scripts/setup.sh" in fixes[0]


def test_doctor_does_not_import_horovod_into_hvdtrain(env):
    """Only hvdtrain.distributed imports horovod, and only when training starts."""
    code = ("import sys, hvdtrain, hvdtrain.doctor, hvdtrain.linear, hvdtrain.mnist\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('horovod', 'tensorflow', 'mpi4py')))\n")
    p = run([sys.executable, "-c", code], env, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr
