#!/usr/bin/env bash
# One host: horovodrun starts the configured number of workers on this machine.
#
#   scripts/launch_local.sh mnist [flags]          # as many processes as --num-workers
#   scripts/launch_local.sh linear --num-workers 4
#   scripts/launch_local.sh mypackage.tasks:MyTask --num-workers 2   # your own task
#   CONTROLLER=--mpi scripts/launch_local.sh mnist # default: Horovod's choice (MPI if built)
#   HVDTRAIN_HUGETLB=0 scripts/launch_local.sh ... # GLIBC_TUNABLES left alone (default: with
#                                                  # glibc.malloc.hugetlb=1, scripts/hugetlb.sh)
#
# The worker count comes from the task's configuration (its --num-workers flag, else the
# task's default: 2 for the seed tasks, 1 for a task that sets none), so the launcher and the
# config agree by construction. Exit status: the ranks' (0, 1, 2, or 75 after a SIGTERM to
# this script, which reaches every process of the job; run the same command to resume).
set -euo pipefail
task=${1:?usage: launch_local.sh TASK [flags]}
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
np=$("$python" -m hvdtrain workers "$task" "$@")  # validates the flags, prints num_workers
# shellcheck disable=SC1091  # scripts/hugetlb.sh, linted on its own
source "$root/scripts/hugetlb.sh"
hvdtrain_hugetlb  # GLIBC_TUNABLES for the ranks: read by glibc at their start, so set here

# horovodrun ends every failed job (and a SIGTERM to it) with a Python traceback of its own
# and status 1, under the ranks' one-line error. Show the ranks' lines, drop that traceback,
# and exit with the first failed rank's own status: 75 after a SIGTERM, 1, or 2.
# horovodrun also asks, in a child process of its own, whether Horovod was built with MPI or
# Gloo by importing horovod.tensorflow: TensorFlow's start-up lines, which the ranks hold back
# (hvdtrain/base/tflogs.py), then come from the launcher. Drop those too unless HVDTRAIN_TF_LOGS=1
# or TF_CPP_MIN_LOG_LEVEL below 2 asks for them.
quiet=1
if [[ "${HVDTRAIN_TF_LOGS:-0}" != 0 || "${TF_CPP_MIN_LOG_LEVEL:-2}" =~ ^[01]$ ]]; then quiet=0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkfifo "$work/stderr"
awk -v codefile="$work/code" -v quiet="$quiet" '
    /^\[[0-9,]+\]<std(out|err)>:/ { print; fflush(); next }  # a rank'"'"'s line: always shown
    quiet && /^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$/ { next }
    quiet && /^[IW][0-9][0-9][0-9][0-9] [0-9:.]+ +[0-9]+ (port|cudart_stub|cpu_feature_guard)\.cc:[0-9]+\] (oneDNN custom operations are on|Could not find cuda drivers|This TensorFlow binary is optimized)/ { next }
    quiet && /^To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler flags\.$/ { next }
    /^Traceback \(most recent call last\):/ { skip = 1 }      # the launcher'"'"'s own
    skip && /^Exit code: [0-9]+/ { code = $3 }
    !skip { print; fflush() }
    END { if (code != "") print code > codefile }' <"$work/stderr" >&2 &
filter=$!
# Its own process group, so that a SIGTERM to this script can reach the ranks themselves
# (horovodrun --mpi does not pass it on to mpirun): they stop at a shared step, rank 0 saves,
# and each exits 75, which the launchers then report.
# shellcheck disable=SC2086  # CONTROLLER is zero or one word
setsid "$(dirname "$python")/horovodrun" -np "$np" ${CONTROLLER:-} \
    "$python" -m hvdtrain "$task" "$@" 2>"$work/stderr" &
job=$!
# shellcheck disable=SC2317  # invoked by the trap below
signal_ranks() {
    local p
    # The ranks: the job's descendants (horovodrun starts them in sessions of their own)
    # that have a rank in their environment.
    for p in $(ps -e -o pid=,ppid= | awk -v root="$job" '{ parent[$1] = $2 } END {
            for (p in parent) { q = p; while ((q in parent) && q != root && q > 1) q = parent[q]
                                if (q == root && p != root) print p } }'); do
        # grep -z on the file itself, not tr | grep -q: under pipefail, grep's early exit
        # left tr's next write a SIGPIPE, the pipeline failed, and a rank whose environment
        # is over tr's 8 KiB buffer went unsignalled (a Ctrl-C that did not stop the job).
        if grep -qzE '^(OMPI_COMM_WORLD_RANK|HOROVOD_RANK)=' "/proc/$p/environ" 2>/dev/null; then
            kill -TERM "$p" 2>/dev/null || true
        fi
    done
}
trap signal_ranks TERM INT
status=0
wait "$job" || status=$?
while kill -0 "$job" 2>/dev/null; do  # a trapped signal ended the wait, not the job
    status=0
    wait "$job" || status=$?
done
wait "$filter" || true
if [[ $status != 0 && -s "$work/code" ]]; then
    status=$(cat "$work/code")
fi
exit "$status"
