"""Check the stack hvdtrain runs on, and say how to fix what is wrong.

    python -m hvdtrain.doctor          # a report; exit 0 if all is well
    python -m hvdtrain.doctor --json   # the same, machine-readable

It reports Python, TensorFlow, the Keras hvdtrain will train with (Keras 3 by default,
Keras 2 from tf_keras under TF_USE_LEGACY_KERAS=1, decided as training decides it),
Horovod (what it was built with, the frameworks it can really use, and the hvdtrain
patches its build carries; for a GPU build the CUDA runtime, NCCL and compiler it used and
the GPU architectures its kernels cover), the MPI library, the GPUs TensorFlow sees (or, in
one line, why none), the launchers, and whether glibc and transparent huge pages let the
ranks' buffers have huge pages (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, which hvdtrain's
launchers and its launched ranks set) and whether this process has them; and it recognises
the known bad combinations. Exit 1 prints one ``problem:`` and one ``fix:`` line per problem.
The facts are read by ``hvdtrain.doctor_probes``; here they are judged.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

from hvdtrain import distributed
from hvdtrain.base import malloc
from hvdtrain.base.errors import error_line
from hvdtrain.doctor_probes import (
    FRAMEWORKS,
    cuda_driver,
    frameworks,
    gpu_build,
    installed_version,
    mpirun_version,
    patches,
)

SETUP = "scripts/setup.sh"
REBUILD = (
    f"pip uninstall -y horovod && {SETUP} (recompiles horovod against this "
    "TensorFlow with HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 and scripts/patches/ applied)"
)
# The patches hvdtrain needs in Horovod 0.28.1 (scripts/patches/, tests/unit/test_doctor.py keeps
# this list equal to it), so that an installed wheel is checked without the repository.
PATCHES = (
    "horovod-0.28.1-gcc14.patch",
    "horovod-0.28.1-gpu-stream-handle.patch",
    "horovod-0.28.1-launch-without-tensorflow.patch",
    "horovod-0.28.1-no-xla-ops.patch",
    "python/horovod-0.28.1-keras-callbacks.patch",
    "python/horovod-0.28.1-keras3-optimizer.patch",
    "python/horovod-0.28.1-keras3-sync-batch-norm.patch",
    "python/horovod-0.28.1-keras3-variables.patch",
    "python/horovod-0.28.1-launch-in-thread.patch",
    "python/horovod-0.28.1-no-xla-kernels.patch",
    "python/horovod-0.28.1-one-tracker-run.patch",
    "python/horovod-0.28.1-ray2.patch",
    "python/horovod-0.28.1-spark-estimator.patch",
    "python/horovod-0.28.1-spark4.patch",
    "python/horovod-0.28.1-sync-unbuilt-optimizer.patch",
)
WHEEL = (
    "pip install --no-deps --force-reinstall horovod-0.28.1+hvdtrain.*.whl (from "
    f"scripts/setup.sh --wheels DIR), or pip uninstall -y horovod && {SETUP}"
)
BUILT = {
    "mpi": "MPI",
    "gloo": "Gloo",
    "nccl": "NCCL",
    "ddl": "DDL",
    "ccl": "CCL",
    "cuda": "CUDA",
    "rocm": "ROCm",
}  # horovod.tensorflow's NAME_built() -> label


def diagnose():
    """(report, problems): what is installed, and [(problem, fix)] for what is wrong."""
    report, problems = {}, []

    def problem(what, fix):
        problems.append({"problem": what, "fix": fix})

    report["python"] = {"version": sys.version.split()[0], "executable": sys.executable}

    # --- TensorFlow and Keras --------------------------------------------------------------
    tf = None
    try:
        import tensorflow as tf

        report["tensorflow"] = {"version": tf.__version__}
    except Exception as e:  # noqa: BLE001 (the doctor reports what fails, and goes on)
        report["tensorflow"] = {"version": None, "error": error_line(e)}
        problem(f"tensorflow cannot be imported ({error_line(e)})", SETUP)

    from hvdtrain.base import compat

    report["tf_keras"] = {"version": installed_version("tf_keras")}
    keras = report["keras"] = {
        "TF_USE_LEGACY_KERAS": os.environ.get("TF_USE_LEGACY_KERAS"),
        "KERAS_BACKEND": os.environ.get("KERAS_BACKEND"),
        "module": None,
        "version": None,
    }
    if tf is not None:
        try:
            k = compat.keras()
            keras.update(module=k.__name__, version=k.__version__)
        except compat.KerasVersionError as e:
            problem(
                f"the Keras hvdtrain would use cannot train: {e}",
                "unset KERAS_BACKEND and TF_USE_LEGACY_KERAS for Keras 3 (the default), "
                f"or {SETUP} for tf_keras",
            )
        try:
            keras["tf.keras"] = tf.keras.__name__
        except Exception as e:  # noqa: BLE001 (tf.keras itself failed to load)
            keras["tf.keras"] = f"unavailable ({error_line(e)})"
        tf_minor = ".".join(tf.__version__.split(".")[:2])
        tk = report["tf_keras"]["version"]
        if compat.legacy_requested() and tk and not tk.startswith(tf_minor + "."):
            problem(
                f"TF_USE_LEGACY_KERAS=1 with tf_keras {tk} on TensorFlow {tf.__version__}: "
                "tf_keras must be the same release as TensorFlow",
                f"pip install tf-keras=={tf_minor}.* (or {SETUP})",
            )

    # --- Horovod ---------------------------------------------------------------------------
    hvd_report = report["horovod"] = {"version": None}
    try:
        horovod = distributed.horovod_package()
        hvd_report["version"] = horovod.__version__
    except Exception as e:  # noqa: BLE001 (reported; the doctor goes on)
        hvd_report["error"] = error_line(e)
        problem(
            f"horovod is not installed ({error_line(e)}); hvdtrain would train one process",
            f"{SETUP} (compiles horovod with HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1)",
        )
    mismatch = distributed.tensorflow_mismatch() if hvd_report["version"] else None
    if mismatch:
        what, fix = mismatch.split(": ", 1)
        hvd_report["error"] = what
        problem(what, fix)
    elif hvd_report["version"] is not None:
        try:
            hvd = distributed.horovod_tensorflow()
            status = hvd_report["framework_status"] = frameworks(os.path.dirname(horovod.__file__))
            # TensorFlow: horovod.tensorflow just loaded; the others: built and installed.
            hvd_report["frameworks"] = ["tensorflow"] + [
                sub for sub in ("torch", "mxnet") if all(status[sub].values())
            ]
            hvd_report["built"] = {name: bool(getattr(hvd, f"{name}_built")()) for name in BUILT}
            hvd_report.update(patches(os.path.dirname(horovod.__file__)))
            absent = [p for p in PATCHES if p not in hvd_report["patches"]]
            if absent:
                problem(
                    f"horovod {horovod.__version__} lacks hvdtrain's patches: {', '.join(absent)}",
                    WHEEL,
                )
            for name, files in hvd_report["patches_changed"].items():
                problem(
                    f"horovod's files of patch {name} changed since the build: {', '.join(files)}",
                    WHEEL,
                )
            if hvd_report["built"]["nccl"] or hvd_report["built"]["cuda"]:
                hvd_report["gpu_build"] = gpu_build(os.path.dirname(horovod.__file__), tf)
            missing = [BUILT[n] for n in ("mpi", "gloo") if not hvd_report["built"][n]]
            if missing:
                problem(
                    f"horovod {horovod.__version__} was built without {' and '.join(missing)}",
                    REBUILD,
                )
        except Exception as e:  # noqa: BLE001 (reported; the doctor goes on)
            hvd_report["error"] = error_line(e)
            if keras["module"] is None and tf is not None:
                pass  # horovod.tensorflow imports Keras: the Keras problem above is the cause
            else:
                problem(
                    f"horovod.tensorflow cannot be imported ({error_line(e)}): horovod "
                    "was built against another TensorFlow, or without TensorFlow",
                    REBUILD,
                )

    # --- MPI, GPUs, launchers --------------------------------------------------------------
    try:
        import mpi4py

        mpi4py.rc.initialize = mpi4py.rc.finalize = False  # only ask, never start MPI
        from mpi4py import MPI

        report["mpi"] = {
            "library": MPI.Get_library_version().splitlines()[0].strip("\0 "),
            "mpi4py": mpi4py.__version__,
        }
    except Exception as e:  # noqa: BLE001 (no mpi4py, or no MPI library it can load)
        # No mpi4py (an environment with the wheels alone): the MPI that runs the ranks is
        # the one mpirun starts, which says its version.
        report["mpi"] = {"library": mpirun_version(), "error": error_line(e)}

    gpus = []
    report["driver"], report["no_gpu"] = cuda_driver()
    # Asked only when the driver has a GPU: CUDA TensorFlow otherwise logs its cuInit errors.
    if tf is not None and report["no_gpu"] is None:
        gpus = [d.name for d in tf.config.list_physical_devices("GPU")]
    report["gpus"] = gpus
    smi = shutil.which("nvidia-smi")
    if smi and not gpus:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
        if listed.returncode == 0 and "GPU" in listed.stdout:
            problem(
                "nvidia-smi lists GPUs but TensorFlow sees none (a CPU-only build, or "
                "CUDA libraries missing)",
                f"HVDTRAIN_GPU=1 {SETUP}",
            )

    search = os.pathsep.join([os.environ.get("PATH", ""), os.path.dirname(sys.executable)])
    report["launchers"] = {
        name: shutil.which(name, path=search) for name in ("horovodrun", "mpirun")
    }
    for name, where in report["launchers"].items():
        if where is None:
            problem(f"{name} is not on PATH or in {os.path.dirname(sys.executable)}", SETUP)

    # Not a problem where absent: training is right either way, only allreduce is slower.
    report["hugepages"] = malloc.state()
    return report, problems


def _line(name, value):
    return f"  {name:<11} {value}"


def _why_not(status, sub):
    return (
        "not built into horovod"
        if not status["built"]
        else f"built but {FRAMEWORKS[sub][1]} not installed"
    )


def _hugepages(h) -> str:
    machine = f"glibc {h['glibc'] or 'absent'}, transparent huge pages {h['thp'] or 'absent'}"
    if h["unavailable"]:
        ranks = f"the ranks' buffers stay on 4 KiB pages ({h['unavailable']})"
    elif h["switch"] == "0":
        ranks = f"launched ranks are left without {malloc.TUNABLE}=1 ({malloc.SWITCH}=0)"
    elif h["ranks_get"] is None:
        ranks = f"launched ranks keep GLIBC_TUNABLES={h['environment']}"
    else:
        ranks = (
            f"launched ranks start with GLIBC_TUNABLES={h['ranks_get']} ({malloc.SWITCH}=0: not)"
        )
    return f"{machine}: {ranks}; this process started " + (
        "with it" if h["this_process_has"] else "without it"
    )


def render(report, problems) -> str:
    tfv, keras, hv, mpi = (report.get(k, {}) for k in ("tensorflow", "keras", "horovod", "mpi"))
    lines = [
        _line("python", f"{report['python']['version']} ({report['python']['executable']})"),
        _line("tensorflow", tfv.get("version") or tfv.get("error")),
        _line(
            "keras",
            f"{keras.get('module') or 'unusable'} {keras.get('version') or ''} "
            f"(tf.keras is {keras.get('tf.keras')}; TF_USE_LEGACY_KERAS="
            f"{keras.get('TF_USE_LEGACY_KERAS')}, KERAS_BACKEND={keras.get('KERAS_BACKEND')})",
        ),
        _line("tf_keras", report["tf_keras"]["version"] or "not installed"),
    ]
    if "built" in hv:

        def on(names):
            return ", ".join(BUILT[n] for n in names if hv["built"][n]) or "none"

        unusable = [
            f"{FRAMEWORKS[sub][0]} {_why_not(st, sub)}"
            for sub, st in hv["framework_status"].items()
            if sub not in hv["frameworks"]
        ]
        lines.append(
            _line(
                "horovod",
                f"{hv['version']}: frameworks {', '.join(hv['frameworks'])}"
                + (f" ({', '.join(unusable)})" if unusable else "")
                + ";"
                f" controllers {on(('mpi', 'gloo'))}; tensor operations "
                f"{on(('nccl', 'ddl', 'ccl', 'mpi', 'gloo'))}; GPU {on(('cuda', 'rocm'))}; "
                f"hvdtrain patches: {', '.join(hv['patches']) or 'none'}",
            )
        )
    else:
        lines.append(_line("horovod", f"{hv.get('version') or '-'} ({hv.get('error')})"))
    gb = hv.get("gpu_build")
    if gb:
        lines.append(
            _line(
                "gpu build",
                f"CUDA runtime {gb['cuda_runtime_wheel']} (the "
                f"nvidia-cuda-runtime-cu12 wheel TensorFlow loads; TensorFlow built "
                f"with CUDA {gb['cuda_runtime']}), NCCL "
                f"{gb['nccl']} (built against {gb['nccl_built'] or 'unknown'}), "
                f"kernels by nvcc {gb['compiler'] or 'unknown (no build record)'}",
            )
        )
        lines.append(
            _line(
                "kernels",
                f"cubins {' '.join(gb['cubin']) or 'none'}; PTX {' '.join(gb['ptx']) or 'none'}",
            )
        )
    lines.append(_line("mpi", mpi.get("library") or f"unknown ({mpi.get('error')})"))
    lines.append(
        _line(
            "gpus",
            ", ".join(report["gpus"])
            or f"none visible: {report['no_gpu'] or 'TensorFlow sees none'}"
            + (
                f" (driver CUDA {report['driver']})"
                if report["driver"] and not report["no_gpu"]
                else ""
            ),
        )
    )
    lines.append(
        _line(
            "launchers", ", ".join(f"{n} {w or 'MISSING'}" for n, w in report["launchers"].items())
        )
    )
    if "hugepages" in report:
        lines.append(_line("hugepages", _hugepages(report["hugepages"])))
    for p in problems:
        lines += [f"problem: {p['problem']}", f"fix: {p['fix']}"]
    lines.append(
        "all good" if not problems else f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hvdtrain.doctor", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report, problems = diagnose()
    if args.json:
        print(json.dumps(dict(report, problems=problems, ok=not problems), indent=2))
    else:
        print(render(report, problems))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
