#!/usr/bin/env bash
# Several hosts with Open MPI and a hostfile, the way Horovod's docs launch on GPU clusters.
#
#   scripts/launch_cluster.sh HOSTFILE TASK [flags]
#
# HOSTFILE: one line per host, "node1 slots=4", one slot per GPU (or per process on CPUs).
# Every host needs the same checkout and venv at the same path, and passwordless ssh.
# Environment:
#   NP=8          processes (default: the task's --num-workers)
#   IFACE=eth0    the network interface MPI, Gloo and NCCL use between hosts
#   PYTHON=...    the interpreter on every host (default: this checkout's .venv)
#   DRY_RUN=1     print the command instead of running it
#   HVDTRAIN_HUGETLB=0  leave GLIBC_TUNABLES alone (default: glibc.malloc.hugetlb=1 added
#                 where this host's glibc and transparent huge pages allow, scripts/hugetlb.sh)
# Forwarded to every host with -x, where set: PATH LD_LIBRARY_PATH PYTHONPATH
# TF_CPP_MIN_LOG_LEVEL HVDTRAIN_TF_LOGS HOROVOD_CYCLE_TIME HOROVOD_FUSION_THRESHOLD
# PYTHONUNBUFFERED TF_USE_LEGACY_KERAS HVDTRAIN_EXIT_FILE HVDTRAIN_LOCK_WAIT GLIBC_TUNABLES
# HVDTRAIN_HUGETLB, and NCCL_DEBUG (default WARN).
set -euo pipefail
hostfile=${1:?usage: launch_cluster.sh HOSTFILE TASK [flags]}
task=${2:?usage: launch_cluster.sh HOSTFILE TASK [flags]}
shift 2
[[ -r "$hostfile" ]] || { echo "launch_cluster.sh: error: cannot read hostfile $hostfile" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
np=${NP:-$("$python" -m hvdtrain workers "$task" "$@")}
# shellcheck disable=SC1091  # scripts/hugetlb.sh, linted on its own
source "$root/scripts/hugetlb.sh"
hvdtrain_hugetlb  # GLIBC_TUNABLES for the ranks: read by glibc at their start, so set here

cmd=(mpirun -np "$np" --hostfile "$hostfile"
     # Horovod: no core binding (TensorFlow sizes its own thread pools per local rank) and
     # ranks filled host by host, so local rank = GPU index.
     --bind-to none --map-by slot
     -x "NCCL_DEBUG=${NCCL_DEBUG:-WARN}"
     # Plain TCP between hosts: InfiniBand's openib BTL is deprecated and unstable with
     # fork(); UCX or NCCL carry the heavy traffic on clusters that have them.
     --mca pml ob1 --mca btl ^openib)
# Forward the environment the workers need; -x NAME copies it from this shell. Only names
# that are set: Open MPI prints a warning for each unset one.
for name in PATH LD_LIBRARY_PATH PYTHONPATH TF_CPP_MIN_LOG_LEVEL HVDTRAIN_TF_LOGS \
            HOROVOD_CYCLE_TIME HOROVOD_FUSION_THRESHOLD PYTHONUNBUFFERED TF_USE_LEGACY_KERAS \
            HVDTRAIN_EXIT_FILE HVDTRAIN_LOCK_WAIT GLIBC_TUNABLES HVDTRAIN_HUGETLB; do
    if [[ -n "${!name+set}" ]]; then cmd+=(-x "$name"); fi
done
if [[ -n "${IFACE:-}" ]]; then
    cmd+=(--mca btl_tcp_if_include "$IFACE" --mca oob_tcp_if_include "$IFACE"
          -x "NCCL_SOCKET_IFNAME=$IFACE" -x "HOROVOD_GLOO_IFACE=$IFACE")
fi
if [[ $(id -u) == 0 ]]; then cmd+=(--allow-run-as-root); fi
cmd+=("$python" -m hvdtrain "$task" "$@")

if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '%q ' "${cmd[@]}"; echo; exit 0; fi
exec "${cmd[@]}"
