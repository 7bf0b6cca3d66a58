#!/usr/bin/env bash
# Set up the environment (idempotent) and run every test:
#
#   scripts/test.sh                 # the whole suite
#   scripts/test.sh -k multiprocess # pytest arguments pass through
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
venv=${HVDTRAIN_VENV:-$root/.venv}
cd "$root"
# mpirun refuses root unless told; CI and containers run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec "$venv/bin/python" -m pytest "$@"
