#!/usr/bin/env bash
# One host: horovodrun starts the configured number of workers on this machine.
#
#   scripts/launch_local.sh mnist [flags]          # as many processes as --num-workers
#   scripts/launch_local.sh linear --num-workers 4
#   scripts/launch_local.sh mypackage.tasks:MyTask --num-workers 2   # your own task
#   CONTROLLER=--mpi scripts/launch_local.sh mnist # default: Horovod's choice (MPI if built)
#
# The worker count comes from the task's configuration (its --num-workers flag, else the
# task's default: 2 for the seed tasks, 1 for a task that sets none), so the launcher and the
# config agree by construction.
set -euo pipefail
task=${1:?usage: launch_local.sh TASK [flags]}
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
np=$("$python" -m hvdtrain workers "$task" "$@")  # validates the flags, prints num_workers
# shellcheck disable=SC2086  # CONTROLLER is zero or one word
exec "$(dirname "$python")/horovodrun" -np "$np" ${CONTROLLER:-} \
    "$python" -m hvdtrain "$task" "$@"
