#!/usr/bin/env bash
# Idempotent environment for hvdtrain: a venv with the locked stack (constraints.txt), Horovod
# compiled against its TensorFlow (or installed from the build cache), and hvdtrain. No root.
#
#   scripts/setup.sh                   # .venv with TensorFlow, Horovod and hvdtrain
#   scripts/setup.sh --wheels DIR      # the same, then Horovod's and hvdtrain's wheels into DIR
#                                      # (pip install --no-deps DIR/*.whl on other machines)
#   scripts/setup.sh --horovod-only    # the venv with the run-time stack and Horovod, without
#                                      # hvdtrain and its test tools (the images' build stage)
#   scripts/setup.sh --check-horovod   # exit 0 if the venv's Horovod needs no rebuild
#
# First it checks what the build needs: Python 3.11-3.13 (with venv and its headers), a C++
# compiler, make, cmake, mpicxx (Open MPI or MPICH: the one first on PATH, e.g. a site's
# `module load`), patch (and patchelf for HVDTRAIN_GPU=1). When something is missing: as root
# on Debian/Ubuntu, apt-get installs it; otherwise one install line per system, and exit 2
# with nothing changed. A second run on a ready machine only verifies (seconds).
# Environment knobs:
#   HVDTRAIN_VENV=DIR           where the virtual environment lives (default: .venv)
#   PYTHON=python3.12           interpreter for a new venv (default: the first of python3.11,
#                               3.12, 3.13, python3 that is 3.11-3.13; a conda env's works)
#   HVDTRAIN_BUILD_CACHE=DIR    the build cache (default ~/.cache/hvdtrain; 0 turns it off): the
#                               finished Horovod wheel of each build, readable by the group
#   HVDTRAIN_SKIP_APT=1         never run apt-get, also as root: only report what is missing
#   HVDTRAIN_GPU=1              CUDA TensorFlow (tensorflow[and-cuda]: CUDA 12.9 runtime, cuDNN,
#                               NCCL wheels) and Horovod with NCCL allreduce. No CUDA toolkit
#                               needed: Horovod's kernels are compiled by nvcc from PyPI's CUDA 13.0
#                               compiler wheels in a build directory deleted afterwards
#   HVDTRAIN_CUDA_HOME=DIR      (GPU) compile with this machine's CUDA toolkit instead (DIR/bin/nvcc)
#   HOROVOD_BUILD_CUDA_CC_LIST  (GPU) compute capabilities to compile kernels for
#                               (default 75,80,86,89,90,100,110,120: every family nvcc 13.0 knows)
# The test-only system packages (SLURM, munge, sshd, shellcheck) are scripts/setup_test.sh's.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HVDTRAIN_VENV:-$root/.venv}
constraints=$root/constraints.txt
horovod_version=0.28.1
# The wheels' local version: 0.28.1+hvdtrain.<revision> (.gpu for the NCCL build), never
# PyPI's 0.28.1. Raise it when what goes into the wheel changes other than by a patch's text
# (the patches themselves are in the build key and in the wheel's hvdtrain_patches.txt).
revision=1
gpu=${HVDTRAIN_GPU:-0}
local_version=hvdtrain.$revision
if [[ "$gpu" == 1 ]]; then local_version+=.gpu; fi
wheel_version=$horovod_version+$local_version

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

mode=setup wheels_dir=""
case "${1:-}" in
    "") ;;
    --check-horovod) mode=check ;;
    --wheels) [[ -n "${2:-}" ]] || die "--wheels needs a directory"; wheels_dir=$2 ;;
    --horovod-only) mode=horovod ;;
    *) die "unknown argument $1 (scripts/setup.sh takes none, --wheels DIR, --horovod-only or --check-horovod)" ;;
esac

# Two kinds of patch (each says why in its header): scripts/patches/*.patch change what is
# compiled, scripts/patches/python/*.patch Python files only. Both are applied to the sdist
# before the wheel is built, so the wheel carries all of them.
patch_sums() { (cd "$root/scripts/patches" && sha1sum horovod-"$horovod_version"-*.patch); }
python_patch_sums() { (cd "$root/scripts/patches/python" && sha1sum horovod-"$horovod_version"-*.patch | sed 's#  #  python/#'); }
all_patch_sums() { patch_sums; python_patch_sums; }

# The Horovod check: exit 0 when $venv's horovod is this wheel version, loads with this
# TensorFlow, has MPI and Gloo (and NCCL for HVDTRAIN_GPU=1), is the build of today's
# patches (a changed patch rebuilds), and its files are as installed (RECORD's sha256). One
# Python process, quiet: a missing horovod is "rebuild".
horovod_ok() {
    "$venv/bin/python" - "$wheel_version" "$gpu" "$(all_patch_sums)" <<'PY' >/dev/null 2>&1
import os, sys
from importlib import metadata
import horovod
assert metadata.version("horovod") == sys.argv[1], metadata.version("horovod")
import horovod.tensorflow as hvd  # fails if built against another TensorFlow
assert hvd.mpi_built() and hvd.gloo_built()
assert sys.argv[2] != "1" or hvd.nccl_built(), "no NCCL"
here = os.path.dirname(horovod.__file__)
with open(os.path.join(here, "hvdtrain_patches.txt")) as f:
    assert f.read().strip() == sys.argv[3].strip(), "built with other patches"
# A GPU build carries its record (compiler, flags, NCCL) for the doctor.
assert sys.argv[2] != "1" or os.path.exists(os.path.join(here, "hvdtrain_build.txt"))
# The wheel's record of what the build answers (horovodrun reads it instead of importing
# TensorFlow before each launch; the launch-without-tensorflow patch): it must be what the
# loaded build answers, and name this install's op library and TensorFlow.
import json
with open(os.path.join(here, "hvdtrain_built.json")) as f:
    record = json.load(f)
assert record["tensorflow"] == metadata.version("tensorflow"), record
assert [record[k] for k in ("mpi", "gloo", "nccl")] == [
    bool(hvd.mpi_built()), bool(hvd.gloo_built()), bool(hvd.nccl_built())], record
lib, = [p for p in metadata.files("horovod") if p.parent.name == "tensorflow"
        and p.name.startswith("mpi_lib") and p.name.endswith(".so")]
assert record["library"] == [lib.hash.mode, lib.hash.value, lib.size], record
# Every installed file of the package is the wheel's (RECORD's sha256): a library or a patched
# file changed since the install is installed again, not trusted. (Not the scripts in bin/.)
import base64, hashlib
for p in metadata.files("horovod"):
    if p.hash is not None and p.parts[0] != "..":
        with open(p.locate(), "rb") as f:
            digest = base64.urlsafe_b64encode(hashlib.new(p.hash.mode, f.read()).digest())
        assert digest.rstrip(b"=").decode() == p.hash.value, p
PY
}

# scripts/setup.sh --check-horovod: only that check, against $HVDTRAIN_VENV (tests use it).
if [[ $mode == check ]]; then
    [[ -x "$venv/bin/python" ]] || die "$venv/bin/python not found"
    horovod_ok; exit
fi

# --- what the build needs, checked before anything is changed ----------------------------
# Python: the venv's if there is one, else PYTHON, else the first 3.11-3.13 on PATH. The lock
# (constraints.txt) holds for 3.11.0 and later: Keras 3.15 and NumPy 2.4 need 3.11
# (tests/unit/test_lock.py checks every pin's Requires-Python against this range), and
# TensorFlow 2.21 has no wheel for 3.14.
py_range="3.11-3.13"
py_ok() { "$1" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null; }
py_version() { "$1" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo "unknown"; }
# A venv whose creation was interrupted (its marker still there) is made again below.
venv_incomplete=$venv/.hvdtrain-venv-incomplete
if [[ -x "$venv/bin/python" && ! -f $venv_incomplete ]]; then
    python=$venv/bin/python
    py_ok "$python" || die "$venv holds Python $(py_version "$python"); hvdtrain's locked stack needs $py_range: remove $venv or set HVDTRAIN_VENV"
    # PYTHON names the interpreter of a new venv; an existing one keeps its own. Another
    # minor version asked for is not what the user would get: say so (same minor: its ABI).
    if [[ -n "${PYTHON:-}" ]] && command -v "$PYTHON" >/dev/null &&
        [[ $(py_version "$PYTHON" | cut -d. -f1,2) != $(py_version "$python" | cut -d. -f1,2) ]]; then
        die "PYTHON=$PYTHON is Python $(py_version "$PYTHON"), but $venv holds Python $(py_version "$python"): remove $venv for a new one, or unset PYTHON"
    fi
elif [[ -n "${PYTHON:-}" ]]; then
    python=$PYTHON
    command -v "$python" >/dev/null || die "PYTHON=$python not found"
    py_ok "$python" || die "PYTHON=$python is Python $(py_version "$python"); hvdtrain's locked stack needs $py_range (TensorFlow 2.21, Keras 3.15, NumPy 2.4)"
else
    python=""
    for p in python3.11 python3.12 python3.13 python3; do
        if command -v "$p" >/dev/null && py_ok "$p"; then python=$p; break; fi
    done
fi
pyver=$([[ -n "$python" ]] && "$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' || echo 3)

# One entry per missing thing: "what|Debian/Ubuntu package|RHEL/Rocky/Fedora package".
missing=() dnf_note=""
need() { missing+=("$1|$2|$3"); }
if [[ -z "$python" ]]; then
    need "Python $py_range (or PYTHON=/path/to/python3.1x)" "python3 python3-venv python3-dev" "python3.11 python3.11-devel"
else
    if [[ $python != "$venv/bin/python" ]] && ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
        need "$python's venv module" "python$pyver-venv" "python$pyver"
    fi
    if ! "$python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
        need "$python's headers (Python.h)" "python$pyver-dev" "python$pyver-devel"
    fi
fi
cxx=$(command -v c++ || command -v g++ || true)
[[ -n "$cxx" ]] || need "a C++ compiler (c++)" g++ gcc-c++
command -v make >/dev/null || need make make make
if ! command -v cmake >/dev/null; then need "cmake 3.13+" cmake cmake
elif ! cmake --version | awk 'NR == 1 {split($3, v, "."); exit !(v[1] > 3 || (v[1] == 3 && v[2] >= 13))}'; then
    need "cmake 3.13+ (found $(cmake --version | head -1))" cmake cmake
fi
if ! command -v mpicxx >/dev/null; then
    need "mpicxx (Open MPI; on a cluster: module load openmpi)" "libopenmpi-dev openmpi-bin" openmpi-devel
    dnf_note="; then: module load mpi/openmpi-x86_64"
elif [[ -n "$cxx" ]] && ! echo '#include <mpi.h>' | mpicxx -x c++ -fsyntax-only - 2>/dev/null; then
    need "mpi.h for $(command -v mpicxx)" libopenmpi-dev openmpi-devel
fi
command -v mpirun >/dev/null || command -v mpiexec >/dev/null || need "mpirun" openmpi-bin openmpi
command -v patch >/dev/null || need patch patch patch
if [[ "$gpu" == 1 ]]; then command -v patchelf >/dev/null || need patchelf patchelf patchelf; fi
if ((${#missing[@]})); then
    apt=() dnf=() what=()
    for m in "${missing[@]}"; do
        IFS='|' read -r w a d <<<"$m"
        what+=("$w"); read -ra words <<<"$a"; apt+=("${words[@]}"); dnf+=("$d")
    done
    if [[ $(id -u) == 0 && "${HVDTRAIN_SKIP_APT:-0}" != 1 ]] && command -v apt-get >/dev/null; then
        # Root on Debian/Ubuntu: install what is missing (only that), then go on.
        log "installing Debian packages: ${apt[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q
        apt-get install -y -q --no-install-recommends "${apt[@]}"
        HVDTRAIN_SKIP_APT=1 exec "$0" "$@"  # checked again; never a second apt-get
    fi
    log "missing: $(printf '%s; ' "${what[@]}" | sed 's/; $//')"
    log "install, then run scripts/setup.sh again (nothing was changed):"
    printf '  apt-get install %s    # Debian, Ubuntu\n' "${apt[*]}"
    printf '  dnf install %s    # RHEL, Rocky, Fedora%s\n' "${dnf[*]}" "$dnf_note"
    exit 2
fi
if [[ -n "$wheels_dir" ]]; then
    mkdir -p "$wheels_dir" || die "--wheels $wheels_dir: cannot create it"
    wheels_dir=$(cd "$wheels_dir" && pwd)
fi

# --- virtual environment -----------------------------------------------------------
# HVDTRAIN_VENV names a venv, or a directory to make one in: never a directory of other files.
if [[ -e $venv && ! -d $venv ]]; then die "HVDTRAIN_VENV=$venv is not a directory"; fi
if [[ -d $venv && ! -x $venv/bin/python && ! -f $venv_incomplete && -n $(ls -A "$venv") ]]; then
    die "$venv holds files but no virtual environment (no bin/python): set HVDTRAIN_VENV to a new or empty directory"
fi
err=$(mkdir -p "$venv" 2>&1) || die "cannot create $venv (${err##*: })"
# One set-up of a venv at a time: a lock on its directory, held until this script ends. A
# second set-up waits, then finds the work done (only verifies).
exec 9<"$venv"
if ! flock -n 9; then
    log "another set-up of $venv is running: waiting for it to end"
    flock 9
fi
# An interrupted creation (Ctrl-C in ensurepip) left a venv without pip: made again, from
# its marker, which proves the directory is this script's.
if [[ -f $venv_incomplete ]]; then
    log "$venv was left half-made by an interrupted set-up: making it again"
    find "$venv" -mindepth 1 -maxdepth 1 ! -name "${venv_incomplete##*/}" -exec rm -rf {} +
fi
if [[ ! -x "$venv/bin/python" || -f $venv_incomplete ]]; then
    log "creating $venv with $python (Python $pyver)"
    : >"$venv_incomplete"
    "$python" -m venv "$venv"
    rm -f "$venv_incomplete"
fi
if ! "$venv/bin/python" -c 'import pip' 2>/dev/null; then
    # A venv made without pip, or one an older set-up left half-made: pip from the
    # interpreter's own copy (ensurepip), not a new venv (the directory may hold more).
    log "$venv has no working pip: installing it with ensurepip"
    "$venv/bin/python" -m ensurepip --upgrade >/dev/null 2>&1 ||
        die "$venv has no pip and ensurepip cannot install it: remove $venv (rm -rf $venv) and run scripts/setup.sh again"
fi
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }

# pip install -c constraints.txt ARGS..., its output kept: when pip refuses, one line says
# what (the pinned package, its version and the Python it needs, where that is the cause),
# not pip's ResolutionImpossible alone. The full output stays in $venv/.hvdtrain-pip.log.
locked_install() {
    local log_file="$venv/.hvdtrain-pip.log"
    # Not -q: the conflict's explanation is in pip's normal output.
    if "$venv/bin/python" -m pip --disable-pip-version-check install -c "$constraints" "$@" \
            >"$log_file" 2>&1; then
        grep '^WARNING' "$log_file" >&2 || true  # what -q would have shown
        return 0
    fi
    die "$(refused "$log_file")"
}
# The one line for a failed locked install. pip names a pin it cannot find ("No matching
# distribution found for X==V", or "no matching distributions available for your
# environment: X, Y" in a conflict); asking pip for that pin alone makes it say which
# Python each of its versions needs ("Ignored the following versions that require a
# different python version: V Requires-Python >=3.11.5").
refused() {
    local log_file=$1 name pin spec why=() names out
    names=$( { sed -n 's/.*No matching distribution found for \([A-Za-z0-9_.-]*\).*/\1/p' "$log_file"
               sed -n 's/.*The user requested (constraint) \([A-Za-z0-9_.-]*\)==.*/\1/p' "$log_file"
               # the names follow on indented lines, or on the same line (older pips)
               awk '/no matching distributions available for your environment:/ {
                        sub(/.*environment:/, ""); print; on = 1; next }
                    on && /^ +[^ ]/ { print; next } { on = 0 }' "$log_file" | tr ',' '\n'; } |
             tr -d ' ' | sed '/^$/d' | sort -u)
    for name in $names; do
        pin=$(grep -i -m1 -E "^${name//[-_.]/[-_.]}==" "$constraints" || true)
        [[ -n "$pin" ]] || continue
        # The pin alone: if it installs, it is not what this machine lacks.
        if out=$("$venv/bin/python" -m pip --disable-pip-version-check install --dry-run \
                     --no-deps --ignore-installed -q "$pin" 2>&1); then continue; fi
        spec=$(sed -n "s/.*different python version: .*\b${pin#*==} Requires-Python \([^;]*\).*/\1/p" <<<"$out" | head -1)
        if [[ -n "$spec" ]]; then why+=("$pin needs Python $spec")
        else why+=("$pin has no release for this machine (Python $(py_version "$venv/bin/python"), $(uname -m))"); fi
    done
    # A file source (find-links, an index without Requires-Python data) is refused after
    # pip reads the wheel: "Package 'X' requires a different Python: V not in 'SPEC'".
    while IFS='|' read -r name spec; do
        [[ -n "$name" ]] || continue
        pin=$(grep -i -m1 -E "^${name//[-_.]/[-_.]}==" "$constraints" || echo "$name")
        why+=("$pin needs Python $spec")
    done < <(sed -n "s/.*Package '\([^']*\)' requires a different Python: .* not in '\([^']*\)'.*/\1|\2/p" "$log_file" | sort -u)
    # No index reached (a proxy, a certificate, no network): that, not "no matching
    # distribution" for the first package asked.
    local unreached
    unreached=$( { sed -n 's/^Could not fetch URL \(.*\) - skipping$/\1/p' "$log_file"
                   sed -n "s/^WARNING: Retrying .* after connection broken by '\(.*\)': \(.*\)/\2: \1/p" "$log_file"; } |
                 head -1 | cut -c1-300)
    if [[ -n "$unreached" ]]; then  # then what it could not find says nothing more
        printf 'pip could not reach the package index: %s (pip'"'"'s output: %s)' "$unreached" "$log_file"
    elif ((${#why[@]})); then
        printf 'constraints.txt cannot install on Python %s (%s): %s (pip'"'"'s output: %s)' \
            "$(py_version "$venv/bin/python")" "$python" "$(printf '%s\n' "${why[@]}" | sort -u | paste -sd';' | sed 's/;/; /g')" "$log_file"
    else
        printf 'pip install -c constraints.txt failed: %s (pip'"'"'s output: %s)' \
            "$(grep -E '^ERROR:' "$log_file" | grep -v 'ResolutionImpossible' | tail -1 | sed 's/^ERROR: //')" "$log_file"
    fi
}

# The locked stack (pyproject.toml's pins, at constraints.txt's versions) plus what Horovod's build
# needs in the same env; the dev tools (test, bench, docs extras) too: this venv runs the tests.
stamp="$venv/.hvdtrain-deps"
installing="$venv/.hvdtrain-installing"  # there while pip installs: an interrupted run's mark
want=$( (cat "$root/pyproject.toml" "$constraints"; echo "gpu=$gpu mode=$mode") | sha1sum | cut -c1-16)
# Packages whose install did not finish (pip killed or Ctrl-C'd while it wrote or compiled
# them): no INSTALLER (pip writes it, then its RECORD, last), no RECORD, or a file of their
# RECORD missing or of another size. pip would take them as installed ("Requirement already
# satisfied") and never mend them.
unfinished() {
    "$venv/bin/python" - <<'PY'
import csv, os, sysconfig
for site in sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")}):
    for name in sorted(os.listdir(site)) if os.path.isdir(site) else []:
        info = os.path.join(site, name)
        if not name.endswith(".dist-info") or os.path.islink(info):  # pip's are directories
            continue
        bad = not all(os.path.isfile(os.path.join(info, f)) for f in ("INSTALLER", "RECORD"))
        if not bad:
            with open(os.path.join(info, "RECORD"), newline="") as f:
                for row in csv.reader(f):
                    if len(row) >= 3 and row[2]:
                        try:
                            bad = os.path.getsize(os.path.join(site, row[0])) != int(row[2])
                        except (OSError, ValueError):
                            bad = True
                        if bad:
                            break
        if bad:
            print(info)
PY
}
if [[ -f $installing || ! -f "$stamp" || $(cat "$stamp") != "$want" ]]; then
    # Forgotten by pip (their dist-info removed), so that the install below writes them whole.
    while read -r info; do
        log "an interrupted install left ${info##*/} unfinished: installing it again"
        rm -rf "$info"
    done < <(unfinished)
    if ! "$venv/bin/python" -c 'import pip' 2>/dev/null; then  # pip itself was among them
        "$venv/bin/python" -m ensurepip --upgrade >/dev/null 2>&1 || die "$venv's pip is broken and ensurepip cannot mend it: remove $venv (rm -rf $venv) and run scripts/setup.sh again"
    fi
    rm -f "$stamp"
    : >"$installing"
    if [[ $mode == horovod ]]; then
        log "installing the locked run-time stack (constraints.txt: TensorFlow, tf-keras, mpi4py)"
    else
        log "installing the locked Python stack (constraints.txt: TensorFlow, tf-keras, mpi4py, test tools)"
    fi
    locked_install --upgrade "pip>=23" "setuptools>=65,<70" wheel packaging
    if [[ "$gpu" == 1 ]]; then
        tf_pin=$(grep -o '"tensorflow==[0-9.]*"' "$root/pyproject.toml" | tr -d '"')
        locked_install "tensorflow[and-cuda]==${tf_pin#tensorflow==}"
    fi
    if [[ $mode == horovod ]]; then
        # pyproject.toml's dependencies and its mpi extra, read without building (the images'
        # build stage has pyproject.toml but not the package it describes).
        mapfile -t reqs < <("$venv/bin/python" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb")).get("project", {})
extras = project.get("optional-dependencies", {})
print(*project.get("dependencies", []), *extras.get("mpi", []), sep="\n")
PY
        )
        ((${#reqs[@]} > 2)) || die "no dependencies found in $root/pyproject.toml"
        locked_install "${reqs[@]}"
    else
        locked_install -e "${root}[mpi,test,bench,docs]"
    fi
    echo "$want" >"$stamp"
    rm -f "$installing"
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
        log "fetching the CUDA compiler from PyPI into the build directory: ${cuda_wheels[*]}" >&3
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
# The build cache: the finished wheel of each build, keyed by everything the build depends on
# (the sdist's version, the patches, the wheel's revision, this venv's Python and TensorFlow,
# the MPI that mpicxx compiles with, the GPU build's compiler, NCCL and settings, any HOROVOD_*
# variable), so that a new venv (a fresh clone, the GPU test's venv) installs the same build
# again instead of compiling it. A wheel cached by pip is never used: pip's key is the sdist
# alone, and a wheel built against another TensorFlow would import and then crash.
cache_root=${HVDTRAIN_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain}
mpi_identity() {
    # The MPI mpicxx really uses (a site module, /usr/lib64/openmpi, Debian's): its compile
    # line and the version its tools report.
    command -v mpicxx
    mpicxx -show 2>/dev/null || mpicxx --showme 2>/dev/null || true
    if command -v ompi_info >/dev/null; then ompi_info --version 2>/dev/null | head -1
    elif command -v mpichversion >/dev/null; then mpichversion 2>/dev/null | head -1
    fi
}
build_key() {
    {
        echo "horovod $wheel_version gpu=$gpu"
        all_patch_sums
        "$venv/bin/python" -c 'import sys; from importlib.metadata import version as v; print(sys.version); print("tensorflow", v("tensorflow"))
try: print("nccl", v("nvidia-nccl-cu12"))
except Exception: pass'
        mpi_identity
        # The variables Horovod's build reads; not those it reads at run time (a process that
        # ran Horovod may hold HOROVOD_CYCLE_TIME and the like: the same build).
        env | grep -E '^HOROVOD_((WITH|WITHOUT)_|GPU|CPU_OPERATIONS|BUILD_|CUDA_|NCCL_|ROCM_|CCL_|MPICXX|CMAKE|DEBUG|ALLOW_MIXED)' | sort || true
        if [[ "$gpu" == 1 ]]; then
            echo "cuda=${HVDTRAIN_CUDA_HOME:-pypi ${cuda_wheels[*]}} cc=${HOROVOD_BUILD_CUDA_CC_LIST:-}"
            echo "cudaflags=${CUDAFLAGS:-}"
        fi
    } | sha1sum | cut -c1-16
}

# The patched files each patch leaves in the wheel, with their sha256 (the doctor compares
# the installed files against them): the files its diff names, or, for a patch that changes
# only compiled code, the op library it was compiled into.
patch_file_sums() {  # run in the unpacked wheel's directory
    local p name f files
    for p in "$root"/scripts/patches/horovod-"$horovod_version"-*.patch "$root"/scripts/patches/python/horovod-"$horovod_version"-*.patch; do
        name=${p#"$root"/scripts/patches/}
        files=()
        while read -r f; do
            if [[ -f "$f" ]]; then files+=("$f"); fi
        done < <(sed -n 's#^+++ b/##p' "$p" | cut -f1)
        if ((${#files[@]} == 0)); then files=(horovod/tensorflow/mpi_lib*.so); fi
        sha256sum "${files[@]}" | awk -v n="$name" '{print $1 "  " n "  " $2}'
    done
}

# Compile the patched sdist into a finished wheel at $1: every patch applied before the build,
# the patch list and the patched files' sums inside, and for the GPU build the op library's
# RUNPATH relative to the wheel's place ($ORIGIN), its NCCL the nvidia-nccl wheel beside it.
build_wheel() {
    local out=$1 src whl dir lib rpath
    export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
    export HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
    MAKEFLAGS="-j$(nproc)"
    export MAKEFLAGS
    # PyPI's sdist, patched: 0.28.1 does not compile against TensorFlow 2.19+ as released
    # (each patch says why in its header). No fork and no vendored copy: the patches are all.
    pip download --no-deps --no-binary :all: --no-cache-dir -d "$build" "horovod==$horovod_version"
    tar -xzf "$build/horovod-$horovod_version.tar.gz" -C "$build"
    src="$build/horovod-$horovod_version"
    if [[ "$gpu" == 1 ]]; then gpu_build_env "$build" "$src"; fi
    for p in "$root"/scripts/patches/horovod-"$horovod_version"-*.patch "$root"/scripts/patches/python/horovod-"$horovod_version"-*.patch; do
        log "applying ${p#"$root"/}" >&3
        patch -p1 -d "$src" --forward --batch --fuzz=0 --quiet -i "$p" ||
            die "$p does not apply to horovod $horovod_version"
    done
    # --no-build-isolation: Horovod must compile against the TensorFlow in this venv.
    # --no-cache-dir: a wheel cached from another TensorFlow would import and then crash.
    # The local version (Horovod's setup.py reads it) only here: pip download checks the sdist's.
    HOROVOD_LOCAL_VERSION=$local_version pip wheel --no-deps --no-build-isolation --no-cache-dir -w "$build/wheel" "$src"
    whl=$(echo "$build"/wheel/horovod-*.whl)
    "$venv/bin/python" -m wheel unpack -d "$build/unpacked" "$whl" >/dev/null
    dir=$(echo "$build"/unpacked/horovod-*)
    if [[ "$gpu" == 1 ]]; then
        # CMake's RUNPATH names the build directory's NCCL, deleted below: the wheel's names
        # nvidia-nccl-cu12's library relative to itself (site-packages/horovod/tensorflow/).
        # shellcheck disable=SC2016  # $ORIGIN is for ld.so, not the shell
        local nccl_run='$ORIGIN/../../nvidia/nccl/lib'
        for lib in "$dir"/horovod/tensorflow/mpi_lib*.so; do
            rpath=$(patchelf --print-rpath "$lib")
            patchelf --set-rpath "${rpath//"$HOROVOD_NCCL_HOME/lib"/$nccl_run}" "$lib"
            rpath=$(patchelf --print-rpath "$lib")
            [[ "$rpath" == *"$nccl_run"* && "$rpath" != *"$build"* ]] ||
                die "$lib: RUNPATH $rpath still names the build directory"
        done
        # What it was compiled with: the doctor reports it (no compiler is left).
        cp "$build/hvdtrain_build.txt" "$dir/horovod/"
    fi
    # Mark the build as hvdtrain's patched one: the doctor reports which patches it carries,
    # and which of their files changed since.
    all_patch_sums >"$dir/horovod/hvdtrain_patches.txt"
    # What the build answers (the build fails without MPI or Gloo; NCCL for the GPU build):
    # horovodrun reads it instead of importing TensorFlow to ask, while the installed op
    # library is this one (its sha256 and size, as pip's RECORD will list them).
    "$venv/bin/python" - "$dir" "$gpu" <<'PY'
import base64, glob, hashlib, json, os, sys
from importlib import metadata
here = os.path.join(sys.argv[1], "horovod")
lib, = glob.glob(os.path.join(here, "tensorflow", "mpi_lib*.so"))
with open(lib, "rb") as f:
    digest = base64.urlsafe_b64encode(hashlib.sha256(f.read()).digest()).rstrip(b"=").decode()
record = {"library": ["sha256", digest, os.path.getsize(lib)],
          "tensorflow": metadata.version("tensorflow"),
          "mpi": True, "gloo": True, "nccl": sys.argv[2] == "1"}
with open(os.path.join(here, "hvdtrain_built.json"), "w") as f:
    json.dump(record, f)
PY
    (cd "$dir" && patch_file_sums) >"$dir/horovod/hvdtrain_patch_files.txt"
    mkdir -p "$out"
    "$venv/bin/python" -m wheel pack -d "$out" "$dir" >/dev/null
}

built=0 wheel=""
# Where the wheel is looked for (the cache, then this user's own when the cache is another
# one) and where a new build is kept: the first of them this user can write. A shared cache
# this user cannot write is read, never written; a build is not thrown away for it.
own_cache=${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain
caches=() store="" key=""
if [[ "$cache_root" != 0 ]]; then
    key=$(build_key)
    caches=("$cache_root")
    if [[ $own_cache != "$cache_root" ]]; then caches+=("$own_cache"); fi
    for c in "${caches[@]}"; do
        if mkdir -p "$c" 2>/dev/null && [[ -w $c ]]; then store=$c; break; fi
    done
fi
entry_of() { echo "$1/horovod-$horovod_version-$key"; }
# Is the entry at $1 fit to install? 0, or 1 with why not in $unfit. Each entry holds the wheel,
# its sha256 (SHA256SUMS, written with it) and the mark that it is whole (complete). Checked
# at every use: a truncated or changed wheel (bytes flipped, a rebuilt library) is never
# installed, and neither is an entry that others than its owner could change (a team cache
# shares by group read: group write would let anyone plant code every import then runs).
unfit=""
entry_ok() {
    local e=$1 open
    unfit=""
    [[ -f $e/complete ]] || { unfit="is unfinished"; return 1; }
    # Made by this user or by the cache's owner: in a cache others can write to, anyone could
    # add an entry of their own making.
    local owner cache_owner
    owner=$(stat -c %u "$e") cache_owner=$(stat -c %u "$(dirname "$e")")
    if [[ $owner != "$(id -u)" && $owner != "$cache_owner" ]]; then
        unfit="is owned by uid $owner, neither this user nor the cache's owner (uid $cache_owner)"; return 1
    fi
    open=$(find "$e" -perm /022 -print -quit 2>/dev/null)
    if [[ -n $open ]]; then unfit="has ${open#"$e"/} writable by others than its owner (mode $(stat -c %A "$open"))"; return 1; fi
    [[ -f $e/SHA256SUMS ]] || { unfit="has no SHA256SUMS (made by an older scripts/setup.sh)"; return 1; }
    (cd "$e" && sha256sum --quiet --strict -c SHA256SUMS >/dev/null 2>&1) ||
        { unfit="does not match its SHA256SUMS (changed or damaged)"; return 1; }
    [[ $(echo "$e"/horovod-*.whl) != *"*"* ]] || { unfit="holds no wheel"; return 1; }
}
# The first fit entry into $entry, else "". An unfit one this user may remove is removed
# (and built again); one of another's is one line naming the command for its owner.
find_entry() {
    local c e
    entry=""
    for c in "${caches[@]}"; do
        e=$(entry_of "$c")
        [[ -e $e ]] || continue
        if entry_ok "$e"; then entry=$e; return; fi
        if [[ $c == "$store" && ( -O $e || $(id -u) == 0 ) ]]; then
            log "the build cache's $e $unfit: removed, not installed"
            rm -rf "$e"
        else
            die "the build cache's $e $unfit: not installed; its owner (uid $(stat -c %u "$e")) removes it (rm -rf $e), or set HVDTRAIN_BUILD_CACHE=0 to build without the cache"
        fi
    done
}
# Build folders live under the cache (else TMPDIR), named by host and process: those of this
# host whose process is gone (a killed set-up) are removed at the next start.
build_base=${store:+$store/.builds}
build_base=${build_base:-${TMPDIR:-/tmp}}
host=$(hostname 2>/dev/null || echo host)
for old in "$build_base"/hvdtrain-build-"$host"-*; do
    [[ -d $old ]] || continue
    pid=${old#"$build_base"/hvdtrain-build-"$host"-}
    pid=${pid%%-*}
    if [[ $pid =~ ^[0-9]+$ && ! -d /proc/$pid ]]; then rm -rf "$old"; fi  # any user's process
done
# The compile's output goes to a log; a failure is one line: the first error there.
build_log="$venv/.hvdtrain-build.log"
build_failed() {
    local first
    first=$(grep -m1 -E '^\[setup\] error: ' "$build_log" | sed 's/^\[setup\] error: //' || true)
    [[ -n $first ]] || first=$(grep -m1 'No space left on device' "$build_log" || true)
    [[ -n $first ]] || first=$(grep -m1 -E '(: (fatal )?error: |CMake Error|^ERROR: )' "$build_log" || true)
    [[ -n $first ]] || first=$(grep -v '^\s*$' "$build_log" | tail -1 || true)
    die "compiling horovod failed: $(cut -c1-400 <<<"$first") (the whole output: $build_log)"
}
# The finished wheel at $wheel: from the cache, or compiled (and then kept in the cache).
wheel_from_cache_or_build() {
    find_entry
    if [[ -n $entry ]]; then wheel=$(echo "$entry"/horovod-*.whl); return; fi
    # Two set-ups of the same build (two clones, two nodes on a shared cache): one compiles,
    # the other waits for it and installs its entry.
    local lock_file=${store:+$store/.lock-$key}
    if [[ -n $store ]] && { [[ -e $lock_file ]] || (umask 0111; : >"$lock_file") 2>/dev/null; } &&
        [[ -r $lock_file ]]; then
        exec 8<"$lock_file"
        if ! flock -n 8; then
            log "another set-up is compiling this build for the cache: waiting for it"
            flock 8
            find_entry
            if [[ -n $entry ]]; then wheel=$(echo "$entry"/horovod-*.whl); return; fi
        fi
    fi
    local place
    for place in "$root" "$venv" "$build_base"; do
        if [[ $place == *[[:space:]]* ]]; then
            die "Horovod's build cannot compile in a path with whitespace: $place (move it, or set HVDTRAIN_VENV / HVDTRAIN_BUILD_CACHE / TMPDIR elsewhere; a cached build installs on any path)"
        fi
    done
    mkdir -p "$build_base" || die "cannot create $build_base"
    build=$(mktemp -d "$build_base/hvdtrain-build-$host-$$-XXXXXX") || die "cannot create a build folder in $build_base"
    trap 'rm -rf "$build"' EXIT
    log "compiling horovod $wheel_version against TensorFlow (a few minutes on 2 cores; the output: $build_log)"
    # Not `( ... ) || build_failed`: errexit is off inside a command that || tests.
    local status=0
    set +e
    ( set -e
      export TMPDIR=$build  # pip's and the compiler's temporary files go with the build
      build_wheel "$build/final" ) 3>&1 >"$build_log" 2>&1
    status=$?
    set -e
    ((status == 0)) || build_failed
    wheel=$(echo "$build"/final/horovod-*.whl)
    if [[ -n $store ]]; then
        local tmp e
        e=$(entry_of "$store")
        if tmp=$(mktemp -d "$store/.new-XXXXXX" 2>/dev/null) &&
            chmod 0755 "$tmp" &&  # mktemp's 0700 would keep the group out of a shared cache
            cp "$wheel" "$tmp/" && chmod 0644 "$tmp"/*.whl &&
            (cd "$tmp" && sha256sum horovod-*.whl >SHA256SUMS) && chmod 0644 "$tmp/SHA256SUMS" &&
            touch "$tmp/complete" && chmod 0644 "$tmp/complete" &&
            { rm -rf "$e"; mv "$tmp" "$e"; }; then
            wheel=$(echo "$e"/horovod-*.whl)
            if [[ $store != "$cache_root" ]]; then log "$cache_root is not writable by uid $(id -u): this build is kept in $store"; fi
        else
            rm -rf "${tmp:-}"
            log "could not keep this build in $store: it is installed from the build folder only"
        fi
    fi
}
if ! horovod_ok; then
    built=1
    wheel_from_cache_or_build
    if [[ -n $entry ]]; then
        log "installing horovod $wheel_version from the build cache ($entry: built from the same sdist, patches, Python, TensorFlow, MPI and settings)"
    fi
    # An installed horovod that failed the check (another TensorFlow, no MPI) would satisfy
    # the pin and never be replaced: removed, once the new wheel is there (until then, the
    # venv's processes keep the one they have).
    pip uninstall -y horovod >/dev/null 2>&1 || true
    # With its dependencies (cloudpickle, psutil, ...) at the lock's versions.
    pip install -c "$constraints" "$wheel"
elif [[ -n "$wheels_dir" ]]; then
    # --wheels on a venv whose Horovod passes: its wheel, from the cache or compiled, while
    # the venv's own install stays as it is (a process may be using it).
    wheel_from_cache_or_build
    if [[ -n $entry ]]; then log "the horovod wheel from the build cache: $entry"; fi
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
if [[ $mode != horovod ]]; then
    "$venv/bin/python" -c "import hvdtrain" || die "hvdtrain does not import from $venv"
fi

# --- wheels: Horovod's (this build) and hvdtrain's, for pip install --no-deps elsewhere ----
if [[ -n "$wheels_dir" ]]; then
    # hvdtrain's from a copy of its sources (the checkout stays free of build/), built aside:
    # only the files of the same names in DIR are replaced, and said so. Other files stay.
    src=$(mktemp -d)
    cp -r "$root/setup.py" "$root/pyproject.toml" "$root/README.md" "$root/hvdtrain" "$src/"
    pip wheel --no-deps --no-build-isolation -w "$src/out" "$src"
    made=("$wheel" "$src"/out/hvdtrain-*.whl "$constraints")
    names=()
    for f in "${made[@]}"; do
        name=${f##*/}
        names+=("$name")
        if [[ -e $wheels_dir/$name ]]; then log "replacing $wheels_dir/$name"; fi
        cp "$f" "$wheels_dir/$name.new-$$" && mv -f "$wheels_dir/$name.new-$$" "$wheels_dir/$name"
    done
    rm -rf "$src"
    tf_version=$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("tensorflow"))')
    log "wheels in $wheels_dir: ${names[0]} ${names[1]}"
    # Other builds' wheels there (another Python, the GPU build, an older hvdtrain) would be
    # taken by DIR/*.whl too, and pip refuses two of one project: then name these two.
    others=$(cd "$wheels_dir" && for f in horovod-*.whl hvdtrain-*.whl; do
                 if [[ -e $f && $f != "${names[0]}" && $f != "${names[1]}" ]]; then echo "$f"; fi
             done | paste -sd' ')
    if [[ -n $others ]]; then
        log "$wheels_dir also holds other wheels ($others): install these two by name"
        log "elsewhere: pip install -c $wheels_dir/constraints.txt $wheels_dir/${names[0]} $wheels_dir/${names[1]} (or --no-deps into an env with TensorFlow $tf_version)"
    else
        log "elsewhere: pip install -c $wheels_dir/constraints.txt $wheels_dir/*.whl (or --no-deps into an env with TensorFlow $tf_version)"
    fi
fi
log "ready: $("$venv/bin/python" -c 'from importlib.metadata import version as v; print("tensorflow", v("tensorflow"), "horovod", v("horovod"))')"
log "activate with: source ${venv#"$root"/}/bin/activate"
