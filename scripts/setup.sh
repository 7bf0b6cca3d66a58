#!/usr/bin/env bash
# Idempotent environment for hvdtrain on Debian 12 (run as root, or with sudo for apt).
#
#   scripts/setup.sh            # Debian packages, .venv, TensorFlow, Horovod, hvdtrain
#
# A second run on a ready machine only verifies (well under a minute).
# Environment knobs:
#   HVDTRAIN_VENV=DIR           where the virtual environment lives (default: .venv)
#   PYTHON=python3.11           interpreter for the venv
#   HVDTRAIN_GPU=1              CUDA TensorFlow (tensorflow[and-cuda]) and Horovod with NCCL
#                               allreduce; needs a CUDA toolkit with NCCL (the CUDA devel images)
#   HVDTRAIN_SKIP_APT=1         skip apt (the packages are already there)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVDTRAIN_VENV:-$root/.venv}
python=${PYTHON:-python3.11}
horovod_version=0.28.1

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# --- Debian packages --------------------------------------------------------------
# Open MPI: Horovod's MPI controller and mpirun; build tools: Horovod compiles from source;
# dataset-fashion-mnist: full Fashion-MNIST with no network; openssh: horovodrun reaches other
# hosts over ssh (tests/test_multihost.py runs an sshd in a network namespace).
apt_packages=(build-essential cmake git openmpi-bin libopenmpi-dev python3-venv python3-dev
              procps iproute2 ca-certificates shellcheck openssh-client openssh-server
              # SLURM 22.05 and munge: tests/test_slurm.py runs scripts/slurm_job.sh on a
              # two-node cluster of its own (the daemons run only while those tests do);
              # srun --mpi=pmix loads libpmix.so from libpmix-dev, which libopenmpi-dev brings
              slurmctld slurmd slurm-client munge)
apt_optional=(dataset-fashion-mnist)  # not in every distribution: --data-dir works instead
gpu=${HVDTRAIN_GPU:-0}
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
horovod_ok() {
    "$venv/bin/python" - "$horovod_version" "$gpu" <<'PY' >/dev/null 2>&1
import sys
import horovod
assert horovod.__version__ == sys.argv[1], horovod.__version__
import horovod.tensorflow as hvd  # fails if built against another TensorFlow
assert hvd.mpi_built() and hvd.gloo_built()
assert sys.argv[2] != "1" or hvd.nccl_built(), "no NCCL"
PY
    # ... and it is the build of today's patches (a changed patch rebuilds).
    local marker
    marker=$("$venv/bin/python" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("horovod").origin))')/hvdtrain_patches.txt
    [[ -f "$marker" && "$(cat "$marker")" == "$(patch_sums)" ]]
}
patch_sums() { (cd "$root/scripts/patches" && sha1sum horovod-"$horovod_version"-*.patch); }
if ! horovod_ok; then
    log "compiling horovod $horovod_version against TensorFlow (a few minutes on 2 cores)"
    export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
    export HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
    MAKEFLAGS="-j$(nproc)"
    export MAKEFLAGS
    if [[ "$gpu" == 1 ]]; then export HOROVOD_GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS:-NCCL}; fi
    # PyPI's sdist, patched: 0.28.1 does not compile against TensorFlow 2.19+ as released
    # (each patch says why in its header). No fork and no vendored copy: the patches are all.
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    pip download --no-deps --no-binary :all: --no-cache-dir -d "$build" "horovod==$horovod_version"
    tar -xzf "$build/horovod-$horovod_version.tar.gz" -C "$build"
    src="$build/horovod-$horovod_version"
    for p in "$root"/scripts/patches/horovod-"$horovod_version"-*.patch; do
        log "applying ${p#"$root"/}"
        (cd "$src" && git apply -p1 "$p") || die "$p does not apply to horovod $horovod_version"
    done
    # --no-build-isolation: Horovod must compile against the TensorFlow in this venv.
    # --no-cache-dir: a wheel cached from another TensorFlow would import and then crash.
    # An installed horovod that failed the check (another TensorFlow, no MPI) would satisfy
    # the pin and never be rebuilt: remove it first.
    pip uninstall -y horovod >/dev/null 2>&1 || true
    pip install --no-build-isolation --no-cache-dir "$src"
    # Mark the build as hvdtrain's patched one: the doctor reports which patches it carries.
    hvd_dir=$("$venv/bin/python" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("horovod").origin))')
    patch_sums >"$hvd_dir/hvdtrain_patches.txt"
fi

# --- verify -------------------------------------------------------------------------
check=$(PATH="$venv/bin:$PATH" "$venv/bin/horovodrun" --check-build 2>&1) || true
wanted=("\[X\] TensorFlow" "\[X\] MPI" "\[X\] Gloo")
if [[ "$gpu" == 1 ]]; then wanted+=("\[X\] NCCL"); fi
for want_line in "${wanted[@]}"; do
    grep -q "$want_line" <<<"$check" || { printf '%s\n' "$check" >&2; die "horovodrun --check-build lacks ${want_line//\\/}"; }
done
"$venv/bin/python" -c "import hvdtrain" || die "hvdtrain does not import from $venv"
log "ready: $("$venv/bin/python" -c 'import tensorflow as tf, horovod; print("tensorflow", tf.__version__, "horovod", horovod.__version__)' 2>/dev/null)"
log "activate with: source ${venv#"$root"/}/bin/activate"
