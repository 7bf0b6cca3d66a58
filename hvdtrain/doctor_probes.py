"""What the doctor reads of the installed stack, each fact from where it lives.

The Horovod build's records (``patches``, ``gpu_build``), the frameworks it can use
(``frameworks``), the GPU kernels in a library (``kernel_architectures``), the NVIDIA driver
(``cuda_driver``) and the MPI that ``mpirun`` starts (``mpirun_version``). They say what is
there; ``hvdtrain.doctor`` judges it and says how to fix what is wrong.
"""

import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sysconfig

PATCH_MARKER = "hvdtrain_patches.txt"  # in hvdtrain's Horovod wheel: the patches it was built with
PATCH_FILES = "hvdtrain_patch_files.txt"  # ... and each patch's files' sha256 as built
BUILD_RECORD = "hvdtrain_build.txt"  # a GPU build's compiler, flags, NCCL: the same
# Horovod's frameworks: label, the framework's module, and horovod/<sub>/<library> that a
# build with it leaves. `horovodrun --check-build` marks a framework [X] when horovod.<sub>
# imports, and horovod.torch imports (printing a warning) with neither its library nor
# PyTorch: the doctor asks for both instead.
FRAMEWORKS = {
    "tensorflow": ("TensorFlow", "tensorflow", "mpi_lib"),
    "torch": ("PyTorch", "torch", "mpi_lib_v2"),
    "mxnet": ("MXNet", "mxnet", "mpi_lib"),
}


def installed_version(dist):
    """The installed version of distribution DIST, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def frameworks(horovod_dir):
    """{sub: {"built": horovod's library for it exists, "installed": the framework is}}."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return {
        sub: {
            "built": os.path.exists(os.path.join(horovod_dir, sub, lib + suffix)),
            "installed": importlib.util.find_spec(module) is not None,
        }
        for sub, (_, module, lib) in FRAMEWORKS.items()
    }


def mpirun_version():
    """The first line of ``mpirun --version`` (``mpirun (Open MPI) 4.1.4``), or None."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    first = (out.stdout.strip().splitlines() or [""])[0].strip()
    return first or None


def patches(horovod_dir):
    """The patches the installed Horovod was built with, and those whose files differ now.

    {"patches": names, "patches_changed": {name: [changed or missing files]}}, from the two
    records the wheel carries; a file's sha256 is compared with the build's."""
    marker = os.path.join(horovod_dir, PATCH_MARKER)
    names = [line.split()[-1] for line in open(marker)] if os.path.exists(marker) else []
    changed = {}
    sums = os.path.join(horovod_dir, PATCH_FILES)
    if os.path.exists(sums):
        base = os.path.dirname(horovod_dir)
        for line in open(sums):
            digest, name, path = line.split()
            try:
                with open(os.path.join(base, path), "rb") as f:
                    same = hashlib.sha256(f.read()).hexdigest() == digest
            except OSError:
                same = False
            if not same:
                changed.setdefault(name, []).append(path)
    return {"patches": names, "patches_changed": changed}


def cuda_driver():
    """(driver's CUDA version, why no GPU is usable or None), asking libcuda directly."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, "no NVIDIA driver (libcuda.so.1 not found)"
    version, count = ctypes.c_int(0), ctypes.c_int(0)
    cuda.cuDriverGetVersion(ctypes.byref(version))
    driver = f"{version.value // 1000}.{version.value % 1000 // 10}"
    status = cuda.cuInit(0)
    if status != 0:
        return (
            driver,
            f"the NVIDIA driver (CUDA {driver}) has no usable GPU (cuInit error {status})",
        )
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return driver, f"the NVIDIA driver (CUDA {driver}) lists no GPU"
    return driver, None


def kernel_architectures(library):
    """(cubin architectures, PTX architectures) embedded in a shared library, read from it.

    setup.sh's GPU build stores uncompressed fatbinaries (nvcc -compress-mode=none), so each
    cubin is an ELF object with machine EM_CUDA (190) and each PTX is text with its target."""
    data = open(library, "rb").read()
    sass, start = set(), data.find(b"\x7fELF", 1)
    while start != -1:
        head = data[start : start + 52]
        if len(head) == 52 and head[4] == 2 and int.from_bytes(head[18:20], "little") == 190:
            flags = int.from_bytes(head[48:52], "little")
            # ELF ABI version 8 and later (CUDA 12.8+) keep the SM in bits 8-15, older in 0-7.
            sass.add(f"sm_{(flags >> 8) & 0xFF if head[8] >= 8 else flags & 0xFF}")
        start = data.find(b"\x7fELF", start + 1)
    ptx = {m.decode() for m in re.findall(rb"\.target\s+(sm_[0-9]+[a-z]?)", data)}
    order = lambda a: int(re.sub(r"\D", "", a))  # noqa: E731
    return sorted(sass, key=order), sorted(ptx, key=order)


def gpu_build(horovod_dir, tf):
    """What a GPU build of Horovod was compiled with and which GPUs its kernels run on."""
    info = {"record": None, "compiler": None, "nccl_built": None, "nvcc_flags": None}
    record = os.path.join(horovod_dir, BUILD_RECORD)
    if os.path.exists(record):
        info["record"] = record
        for line in open(record):
            key, _, value = line.rstrip("\n").partition("=")
            info["nccl_built" if key == "nccl" else key] = value
    info["nccl"] = installed_version("nvidia-nccl-cu12")  # the library loaded at run time
    build = tf.sysconfig.get_build_info() if tf is not None else {}
    info["cuda_runtime"] = build.get("cuda_version")  # TensorFlow's build, not what it loads
    info["cudnn"] = build.get("cudnn_version")
    info["cuda_runtime_wheel"] = installed_version("nvidia-cuda-runtime-cu12")
    library = next(
        (
            os.path.join(horovod_dir, "tensorflow", f)
            for f in os.listdir(os.path.join(horovod_dir, "tensorflow"))
            if f.startswith("mpi_lib") and f.endswith(".so")
        ),
        None,
    )
    info["cubin"], info["ptx"] = kernel_architectures(library) if library else ([], [])
    return info
