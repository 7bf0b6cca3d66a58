#!/usr/bin/env bash
# Set up the environment (idempotent) and run the tests.
#
#   scripts/test.sh                 # everything, as CI runs it (.ci/run): the checks, then
#                                   # three passes:
#     1. the whole suite under Keras 3 (the default);
#     2. the tests marked keras2 (what Keras 2 changes: parity, exact resume, the fit path, the
#        Task API, mixed precision, accumulation) again under Keras 2, with
#        TF_USE_LEGACY_KERAS=1 (HVDTRAIN_KERAS2=0 skips this pass);
#     3. scripts/test_gpu_build.sh: the GPU build with no CUDA toolkit visible, in its own venv
#        (.venv-gpu, made during pass 2), trained with on CPU ranks (HVDTRAIN_GPU_TEST=0 skips it).
#   scripts/test.sh --quick         # the inner loop: the checks and the tests marked quick
#                                   # (unit-level tests and one 2-rank run of each path: Task,
#                                   # fit, tf.data), Keras 3 only, no GPU build; a few minutes
#   scripts/test.sh -k multiprocess # pytest arguments pass through (to both pytest passes)
#
# The checks come first, in seconds: ruff (lint and format), mypy and the layers' import
# contracts (lint-imports), with pyproject.toml's settings, as the pre-commit hooks run them;
# one that fails fails the run, after the tests. Each pass's time and the total are printed at
# the end. HVDTRAIN_SETUP=0 skips the set-up (the environment is ready; the test of this
# script's --quick runs it so). HVDTRAIN_TEST_TIME_SCALE=N multiplies
# every test's time bound (a slower or busier machine than these 2 cores).
#
# The pytest passes run on HVDTRAIN_TEST_WORKERS pytest-xdist workers (default 2, 1 on one
# core; 1 runs pytest alone): a test's ranks leave a core idle for a third of the time (start,
# waits on signals, watchdogs, daemons), which the other worker's test takes. Each module is one
# group on one worker (tests/conftest.py), so its shared launches still run once.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
quick=0
if [[ "${1:-}" == --quick ]]; then quick=1; shift; fi
start=$SECONDS
times=()
timed() {  # timed NAME START: one line of the closing summary
    times+=("$(printf '%-14s %4d s (%d min %02d s)' "$1" $((SECONDS - $2)) $(((SECONDS - $2) / 60)) $(((SECONDS - $2) % 60)))")
}
if [[ "${HVDTRAIN_SETUP:-1}" == 1 ]]; then  # 0: the environment is set up already
    "$root/scripts/setup.sh"
    "$root/scripts/setup_test.sh"  # the tests' own system packages (SLURM, sshd, shellcheck)
fi
timed setup "$start"
venv=${HVDTRAIN_VENV:-$root/.venv}
cd "$root"
# mpirun refuses root unless told; CI and containers run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset TF_USE_LEGACY_KERAS
workers=${HVDTRAIN_TEST_WORKERS:-$(( $(nproc) > 1 ? 2 : 1 ))}
parallel=()
if (( workers > 1 )); then parallel=(-n "$workers" --dist loadgroup); fi
status=0
# The style and the layers, held by tools: lint, format, types, import contracts.
echo "=== checks: ruff, ruff format, mypy, lint-imports ==="
t=$SECONDS
checks=(hvdtrain tests tools examples)
for tool in ruff mypy lint-imports; do
    if [[ ! -x "$venv/bin/$tool" ]]; then
        echo "$venv has no $tool (the test extra): run scripts/setup.sh" >&2; status=1
    fi
done
if [[ $status == 0 ]]; then
    "$venv/bin/ruff" check --no-cache "${checks[@]}" || status=1
    "$venv/bin/ruff" format --check --no-cache "${checks[@]}" || status=1
    "$venv/bin/mypy" || status=1
    "$venv/bin/lint-imports" --no-cache --no-logo || status=1
fi
timed checks "$t"
echo "=== pytest on $workers worker(s) (HVDTRAIN_TEST_WORKERS) ==="
t=$SECONDS
if [[ $quick == 1 ]]; then
    "$venv/bin/python" -m pytest "${parallel[@]}" -m quick "$@" || status=$?
    timed "quick pass" "$t"
else
    "$venv/bin/python" -m pytest "${parallel[@]}" "$@" || status=$?
    timed "Keras 3 pass" "$t"
    gpu_setup=
    if [[ "${HVDTRAIN_KERAS2:-1}" == 1 ]]; then
        if [[ "${HVDTRAIN_GPU_TEST:-1}" == 1 ]]; then
            # The GPU build's venv is made beside the Keras 2 pass: most of its 2.5 minutes
            # are pip unpacking 4 GB of CUDA wheels, which the pass's ranks leave the disk for.
            # Its output is shown after the pass; the GPU build test below checks the venv.
            gpu_log=$(mktemp)
            "$root/scripts/test_gpu_build.sh" --setup-only >"$gpu_log" 2>&1 &
            gpu_setup=$!
        fi
        echo "=== Keras 2 pass: TF_USE_LEGACY_KERAS=1 pytest -m keras2 ==="
        keras2=0
        t=$SECONDS
        TF_USE_LEGACY_KERAS=1 "$venv/bin/python" -m pytest "${parallel[@]}" -m keras2 "$@" ||
            keras2=$?
        timed "Keras 2 pass" "$t"
        # 5: the arguments selected no keras2 test; not a failure of this pass.
        if [[ $keras2 != 0 && $keras2 != 5 ]]; then status=$keras2; fi
    fi
    if [[ "${HVDTRAIN_GPU_TEST:-1}" == 1 ]]; then
        echo "=== GPU build: scripts/test_gpu_build.sh ==="
        t=$SECONDS
        if [[ -n "$gpu_setup" ]]; then
            echo "== its venv, made during the Keras 2 pass (scripts/test_gpu_build.sh --setup-only):"
            wait "$gpu_setup" || echo "== that setup failed; the test below makes the venv again"
            cat "$gpu_log"
            rm -f "$gpu_log"
        fi
        "$root/scripts/test_gpu_build.sh" || status=1
        timed "GPU build" "$t"
    fi
fi
timed total "$start"
echo "=== scripts/test.sh: times ==="
printf '%s\n' "${times[@]}"
exit "$status"
