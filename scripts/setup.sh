#!/usr/bin/env bash
# Idempotent environment for hvdtrain on Debian 12 (run as root, or with sudo for apt).
#
#   scripts/setup.sh            # Debian packages, .venv, TensorFlow, Horovod, hvdtrain
#   scripts/setup.sh --check-horovod   # exit 0 if the venv's Horovod needs no rebuild
#
# A second run on a ready machine only verifies (well under a minute).
# Environment knobs:
#   HVDTRAIN_VENV=DIR           where the virtual environment lives (default: .venv)
#   PYTHON=python3.11           interpreter for the venv
#   HVDTRAIN_GPU=1              CUDA TensorFlow (tensorflow[and-cuda]: CUDA 12.9 runtime, cuDNN,
#                               NCCL wheels) and Horovod with NCCL allreduce. No CUDA toolkit
#                               needed: Horovod's kernels are compiled by nvcc from PyPI's CUDA 13.0
#                               compiler wheels in a build directory deleted afterwards
#   HVDTRAIN_CUDA_HOME=DIR      (GPU) compile with this machine's CUDA toolkit instead (DIR/bin/nvcc)
#   HOROVOD_BUILD_CUDA_CC_LIST  (GPU) compute capabilities to compile kernels for
#                               (default 75,80,86,89,90,100,110,120: every family nvcc 13.0 knows)
#   HVDTRAIN_SKIP_APT=1         skip apt (the packages are already there)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVDTRAIN_VENV:-$root/.venv}
python=${PYTHON:-python3.11}
horovod_version=0.28.1
gpu=${HVDTRAIN_GPU:-0}

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# The Horovod check: exit 0 when $venv's horovod is this version, loads with this TensorFlow,
# has MPI and Gloo (and NCCL for HVDTRAIN_GPU=1), and is the build of today's patches (a
# changed patch rebuilds). One Python process, quiet: a missing horovod is just "rebuild".
horovod_ok() {
    "$venv/bin/python" - "$horovod_version" "$gpu" "$(all_patch_sums)" <<'PY' >/dev/null 2>&1
import os, sys
import horovod
assert horovod.__version__ == sys.argv[1], horovod.__version__
import horovod.tensorflow as hvd  # fails if built against another TensorFlow
assert hvd.mpi_built() and hvd.gloo_built()
assert sys.argv[2] != "1" or hvd.nccl_built(), "no NCCL"
here = os.path.dirname(horovod.__file__)
with open(os.path.join(here, "hvdtrain_patches.txt")) as f:
    assert f.read().strip() == sys.argv[3].strip(), "built with other patches"
# A GPU build carries its record (compiler, flags, NCCL) for the doctor.
assert sys.argv[2] != "1" or os.path.exists(os.path.join(here, "hvdtrain_build.txt"))
# What the loaded build answered, for horovodrun (the launch-without-tensorflow patch): it
# then starts ranks without importing TensorFlow itself. Valid while the op library and
# TensorFlow are the ones recorded.
import json
from importlib import metadata
from horovod.common.util import get_extension_full_path
lib = os.stat(get_extension_full_path(os.path.join(here, "tensorflow", "__init__.py"), "mpi_lib"))
record = {"library": [lib.st_size, lib.st_mtime_ns], "tensorflow": metadata.version("tensorflow"),
          "mpi": bool(hvd.mpi_built()), "gloo": bool(hvd.gloo_built()),
          "nccl": bool(hvd.nccl_built())}
path = os.path.join(here, "hvdtrain_built.json")
try:
    with open(path) as f:
        same = json.load(f) == record
except (OSError, ValueError):
    same = False
if not same:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
PY
}
# Two kinds of patch (each says why in its header): scripts/patches/*.patch are applied to the
# sdist before it compiles (they are in the build cache's key); scripts/patches/python/*.patch
# change Python files only and are applied to the installed package after each install, so a
# change to one reinstalls the cached build instead of compiling it again.
patch_sums() { (cd "$root/scripts/patches" && sha1sum horovod-"$horovod_version"-*.patch); }
python_patch_sums() { (cd "$root/scripts/patches/python" && sha1sum horovod-"$horovod_version"-*.patch | sed 's#  #  python/#'); }
all_patch_sums() { patch_sums; python_patch_sums; }

# scripts/setup.sh --check-horovod: only that check, against $HVDTRAIN_VENV (tests use it).
case "${1:-}" in
    "") ;;
    --check-horovod) [[ -x "$venv/bin/python" ]] || die "$venv/bin/python not found"
                     horovod_ok; exit ;;
    *) die "unknown argument $1 (scripts/setup.sh takes none, or --check-horovod)" ;;
esac

# --- Debian packages --------------------------------------------------------------
# Open MPI: Horovod's MPI controller and mpirun; build tools: Horovod compiles from source;
# dataset-fashion-mnist: full Fashion-MNIST with no network; openssh: horovodrun reaches other
# hosts over ssh (tests/test_multihost.py runs an sshd in a network namespace); patchelf: a GPU
# build's op library is pointed at the venv's NCCL; patch: scripts/patches/python/ on the
# installed Horovod.
apt_packages=(build-essential cmake git openmpi-bin libopenmpi-dev python3-venv python3-dev
              procps iproute2 ca-certificates shellcheck openssh-client openssh-server patchelf patch
              # SLURM 22.05 and munge: tests/test_slurm.py runs scripts/slurm_job.sh on a
              # two-node cluster of its own (the daemons run only while those tests do);
              # srun --mpi=pmix loads libpmix.so from libpmix-dev, which libopenmpi-dev brings
              slurmctld slurmd slurm-client munge)
apt_optional=(dataset-fashion-mnist)  # not in every distribution: --data-dir works instead
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
if [[ "${HVDTRAIN_SKIP_APT:-0}" != 1 ]]; then
    missing=()
    for p in "${apt_packages[@]}" "${apt_optional[@]}"; do installed "$p" || missing+=("$p"); done
    if ((${#missing[@]})); then
        log "installing Debian packages: ${missing[*]}"
        sudo=""; [[ $(id -u) == 0 ]] || sudo=sudo
        export DEBIAN_FRONTEND=noninteractive
        $sudo apt-get update -q
        $sudo apt-get install -y -q --no-install-recommends "${apt_packages[@]}"
        for p in "${apt_optional[@]}"; do
            $sudo apt-get install -y -q --no-install-recommends "$p" ||
                log "warning: optional package $p unavailable; Fashion-MNIST needs --data-dir"
        done
    fi
fi
command -v "$python" >/dev/null || die "$python not found (install python3.11 or set PYTHON=...)"

# --- virtual environment -----------------------------------------------------------
if [[ ! -x "$venv/bin/python" ]]; then
    log "creating $venv with $python"
    "$python" -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }

# The pinned stack (from setup.py) plus what Horovod's build needs in the same env.
stamp="$venv/.hvdtrain-deps"
want=$( (cat "$root/setup.py"; echo "gpu=$gpu") | sha1sum | cut -c1-16)
if [[ ! -f "$stamp" || $(cat "$stamp") != "$want" ]]; then
    log "installing the pinned Python stack (TensorFlow, tf-keras, mpi4py, test tools)"
    pip install --upgrade "pip>=23" "setuptools>=65,<70" wheel packaging
    if [[ "$gpu" == 1 ]]; then
        tf_pin=$(grep -o '"tensorflow==[0-9.]*"' "$root/setup.py" | tr -d '"')
        pip install "tensorflow[and-cuda]==${tf_pin#tensorflow==}"
    fi
    pip install -e "${root}[mpi,test,bench]"
    echo "$want" >"$stamp"
fi

# --- Horovod, compiled against this TensorFlow -------------------------------------
# GPU build: a CUDA compiler and NCCL for Horovod's CMake, without a CUDA toolkit installed.
# TensorFlow's wheels bring the CUDA 12.9 runtime and NCCL (nvidia-nccl-cu12), but no
# nvidia-cuda-nvcc-cu12 wheel holds nvcc; the CUDA 13.0 compiler wheels do. They go into the
# build directory, laid out as the toolkit directory CMake expects, and are deleted with it.
cuda_wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
             nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
gpu_build_env() {
    local build=$1 src=$2 cuda nccl site
    export HOROVOD_GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS:-NCCL}
    if [[ -n "${HVDTRAIN_CUDA_HOME:-}" ]]; then
        cuda=$HVDTRAIN_CUDA_HOME
        [[ -x "$cuda/bin/nvcc" ]] || die "HVDTRAIN_CUDA_HOME=$cuda: no bin/nvcc there"
        echo "compiler_source=$cuda" >"$build/hvdtrain_build.txt"
    else
        cuda=$build/cuda
        log "fetching the CUDA compiler from PyPI into the build directory: ${cuda_wheels[*]}"
        # One pip call: the wheels share nvidia/cu13/, which a second --upgrade call deletes.
        pip install --no-deps --target "$build/cuda-wheels" "${cuda_wheels[@]}"
        local cu=$build/cuda-wheels/nvidia/cu13 f
        # nvcc takes bin/.. as the toolkit root: bin/ is a directory of links, not a link.
        mkdir -p "$cuda/bin" "$cuda/lib64"
        for f in "$cu"/bin/*; do ln -s "$f" "$cuda/bin/"; done
        ln -s "$cu/include" "$cuda/include"
        ln -s "$cu/nvvm" "$cuda/nvvm"
        for f in libcudart_static.a libcudadevrt.a libcudart.so.13; do ln -s "$cu/lib/$f" "$cuda/lib64/"; done
        ln -s libcudart.so.13 "$cuda/lib64/libcudart.so"
        echo "compiler_source=pypi ${cuda_wheels[*]}" >"$build/hvdtrain_build.txt"
        export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-75,80,86,89,90,100,110,120}
    fi
    # NCCL from TensorFlow's own wheel (the library TensorFlow loads too); CMake's FindNCCL
    # wants a libnccl.so beside the wheel's libnccl.so.2, made here rather than in the venv.
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [[ -f "$site/nvidia/nccl/lib/libnccl.so.2" ]] || die "no NCCL wheel in $venv (tensorflow[and-cuda] brings nvidia-nccl-cu12)"
    nccl=$build/nccl
    mkdir -p "$nccl/lib"
    ln -s "$site/nvidia/nccl/include" "$nccl/include"
    ln -s "$site/nvidia/nccl/lib/libnccl.so.2" "$nccl/lib/libnccl.so"
    export HOROVOD_CUDA_HOME=$cuda HOROVOD_NCCL_HOME=$nccl HOROVOD_NCCL_LINK=SHARED
    # Horovod's CMake runs the first nvcc on PATH: make it this one.
    PATH=$cuda/bin:$PATH
    # Uncompressed fatbinaries (a few hundred KB): Horovod's kernels are registered through
    # TensorFlow's CUDA 12.9 runtime and loaded by the machine's driver, both older than
    # nvcc 13.0's compressed formats.
    if grep -q -- --compress-mode <<<"$("$cuda/bin/nvcc" --help)"; then export CUDAFLAGS="${CUDAFLAGS:-} -compress-mode=none"; fi
    {
        echo "compiler=$("$cuda/bin/nvcc" --version | grep -o 'release [0-9.]*, V[0-9.]*')"
        # The flags Horovod's CMake gives nvcc, computed the way it does.
        echo "nvcc_flags=$(cd "$src/cmake" && "$venv/bin/python" -c 'import build_utils; print(" ".join(build_utils.get_nvcc_flags()))')${CUDAFLAGS:-}"
        echo "nccl=$(awk '/^#define NCCL_(MAJOR|MINOR|PATCH) /{v = v (v ? "." : "") $3} END {print v}' "$nccl/include/nccl.h")"
    } >>"$build/hvdtrain_build.txt"
}
# The build cache: the wheel of each build, keyed by everything the build depends on (the
# sdist's version, the patches, this venv's Python and TensorFlow, Open MPI's headers, the GPU
# build's compiler, NCCL and settings, any HOROVOD_* variable), so that a new venv (a fresh
# clone, the GPU test's venv) installs the same build again instead of compiling it. A wheel
# cached by pip is never used: pip's key is the sdist alone, and a wheel built against
# another TensorFlow would import and then crash. HVDTRAIN_BUILD_CACHE=0 turns it off.
cache_root=${HVDTRAIN_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain}
build_key() {
    {
        echo "horovod $horovod_version gpu=$gpu"
        patch_sums
        "$venv/bin/python" -c 'import sys; from importlib.metadata import version as v; print(sys.version); print("tensorflow", v("tensorflow"))
try: print("nccl", v("nvidia-nccl-cu12"))
except Exception: pass'
        dpkg-query -W -f='${Package} ${Version}\n' libopenmpi-dev 2>/dev/null || true
        env | grep '^HOROVOD_' | sort || true
        if [[ "$gpu" == 1 ]]; then
            echo "cuda=${HVDTRAIN_CUDA_HOME:-pypi ${cuda_wheels[*]}} cc=${HOROVOD_BUILD_CUDA_CC_LIST:-}"
            echo "cudaflags=${CUDAFLAGS:-}"
        fi
    } | sha1sum | cut -c1-16
}
built=0
if ! horovod_ok; then
    built=1
    # An installed horovod that failed the check (another TensorFlow, no MPI) would satisfy
    # the pin and never be rebuilt: remove it first.
    pip uninstall -y horovod >/dev/null 2>&1 || true
    entry=""
    if [[ "$cache_root" != 0 ]]; then entry="$cache_root/horovod-$horovod_version-$(build_key)"; fi
    if [[ -n "$entry" && -f "$entry/complete" ]]; then
        log "installing horovod $horovod_version from the build cache ($entry: built from the same sdist, patches, Python, TensorFlow, MPI and settings)"
        pip install "$entry"/horovod-*.whl
        record="$entry"
    else
        log "compiling horovod $horovod_version against TensorFlow (a few minutes on 2 cores)"
        export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
        export HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
        MAKEFLAGS="-j$(nproc)"
        export MAKEFLAGS
        # PyPI's sdist, patched: 0.28.1 does not compile against TensorFlow 2.19+ as released
        # (each patch says why in its header). No fork and no vendored copy: the patches are all.
        build=$(mktemp -d)
        trap 'rm -rf "$build"' EXIT
        pip download --no-deps --no-binary :all: --no-cache-dir -d "$build" "horovod==$horovod_version"
        tar -xzf "$build/horovod-$horovod_version.tar.gz" -C "$build"
        src="$build/horovod-$horovod_version"
        if [[ "$gpu" == 1 ]]; then gpu_build_env "$build" "$src"; fi
        for p in "$root"/scripts/patches/horovod-"$horovod_version"-*.patch; do
            log "applying ${p#"$root"/}"
            (cd "$src" && git apply -p1 "$p") || die "$p does not apply to horovod $horovod_version"
        done
        # --no-build-isolation: Horovod must compile against the TensorFlow in this venv.
        # --no-cache-dir: a wheel cached from another TensorFlow would import and then crash.
        pip wheel --no-deps --no-build-isolation --no-cache-dir -w "$build/wheel" "$src"
        pip install "$build"/wheel/horovod-*.whl
        # The build directory's NCCL, which the op library's RUNPATH names (rewritten below).
        if [[ "$gpu" == 1 ]]; then echo "$HOROVOD_NCCL_HOME" >"$build/nccl_home"; fi
        record="$build"
        if [[ -n "$entry" ]] && mkdir -p "$cache_root" 2>/dev/null; then
            tmp=$(mktemp -d "$cache_root/.new-XXXXXX")
            cp "$build"/wheel/horovod-*.whl "$tmp/"
            for f in hvdtrain_build.txt nccl_home; do
                if [[ -f "$build/$f" ]]; then cp "$build/$f" "$tmp/"; fi
            done
            touch "$tmp/complete"
            rm -rf "$entry"
            mv "$tmp" "$entry" || rm -rf "$tmp"
        fi
    fi
    hvd_dir=$("$venv/bin/python" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("horovod").origin))')
    # The Python patches, on the files just installed (pristine: the wheel has none of them).
    for p in "$root"/scripts/patches/python/horovod-"$horovod_version"-*.patch; do
        log "applying ${p#"$root"/}"
        patch -p1 -d "$(dirname "$hvd_dir")" --forward --batch --quiet -i "$p" \
            || die "$p does not apply to the installed horovod $horovod_version"
    done
    # Mark the build as hvdtrain's patched one: the doctor reports which patches it carries.
    all_patch_sums >"$hvd_dir/hvdtrain_patches.txt"
    if [[ "$gpu" == 1 ]]; then
        # The op library finds NCCL in the venv's wheel, not in the build directory deleted
        # below (CMake put that in its RUNPATH): no LD_LIBRARY_PATH needed.
        # shellcheck disable=SC2016  # $ORIGIN is for ld.so, not the shell
        nccl_run='$ORIGIN/../../nvidia/nccl/lib'
        nccl_home=$(cat "$record/nccl_home")
        for lib in "$hvd_dir"/tensorflow/mpi_lib*.so; do
            rpath=$(patchelf --print-rpath "$lib")
            patchelf --set-rpath "${rpath//"$nccl_home/lib"/$nccl_run}" "$lib"
        done
        # ... and what it was compiled with: the doctor reports it (no compiler is left).
        cp "$record/hvdtrain_build.txt" "$hvd_dir/hvdtrain_build.txt"
    fi
fi

# --- verify -------------------------------------------------------------------------
# After a build: horovodrun's own check (each of its lines imports TensorFlow in a child, half a
# minute), then horovod_ok, which also records the answers for horovodrun. On a ready machine,
# horovod_ok above has asked the loaded build the same, in one process.
if [[ $built == 1 ]]; then
    check=$(PATH="$venv/bin:$PATH" "$venv/bin/horovodrun" --check-build 2>&1) || true
    wanted=("\[X\] TensorFlow" "\[X\] MPI" "\[X\] Gloo")
    if [[ "$gpu" == 1 ]]; then wanted+=("\[X\] NCCL"); fi
    for want_line in "${wanted[@]}"; do
        grep -q "$want_line" <<<"$check" || { printf '%s\n' "$check" >&2; die "horovodrun --check-build lacks ${want_line//\\/}"; }
    done
    horovod_ok || die "the new horovod build does not load with this TensorFlow (python -c 'import horovod.tensorflow')"
fi
"$venv/bin/python" -c "import hvdtrain" || die "hvdtrain does not import from $venv"
log "ready: $("$venv/bin/python" -c 'from importlib.metadata import version as v; print("tensorflow", v("tensorflow"), "horovod", v("horovod"))')"
log "activate with: source ${venv#"$root"/}/bin/activate"
