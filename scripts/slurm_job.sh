#!/usr/bin/env bash
# hvdtrain on a SLURM allocation: one process per GPU on every node. Submit it from the
# root of the checkout (the same path, with its .venv, on every node, e.g. a shared home):
#
#   sbatch scripts/slurm_job.sh                               # MNIST, the defaults below
#   sbatch --nodes=4 scripts/slurm_job.sh mnist --epochs 20 --data-dir /shared/mnist
#   sbatch --export=ALL,IFACE=ib0 scripts/slurm_job.sh linear
#   sbatch --export=ALL,LAUNCHER=mpirun scripts/slurm_job.sh  # Open MPI's mpirun instead of srun
#
# Arguments: TASK (linear or mnist, default mnist) and hvdtrain flags; the run directory
# defaults to runs/TASK-JOBID under the submit directory (a later --run-dir wins).
# Environment (sbatch passes the submitting shell's environment by default):
#   IFACE=ib0        the network interface between nodes, for MPI, Gloo and NCCL
#   LAUNCHER=srun    srun (default; needs SLURM's PMIx plugin and an MPI built with PMIx)
#                    or mpirun (scripts/launch_cluster.sh with a hostfile of the allocation)
#   SRUN_MPI=pmix    srun's --mpi plugin (srun --mpi=list shows yours; e.g. pmix_v3)
#   PYTHON=...       the interpreter on every node (default: the checkout's .venv)
#   DRY_RUN=1        print the launch command instead of running it
#
# Change the #SBATCH lines below to your cluster (partition, account, GPUs per node).
# One task per GPU: --ntasks-per-node equals the GPUs per node. --gres gives every task of
# a node all of its GPUs and hvdtrain pins GPU number = local rank (with memory growth);
# --gpus-per-task=1 also works (each process then sees one GPU) but, where SLURM isolates
# devices with cgroups, can keep NCCL from copying directly between a node's GPUs.
#SBATCH --job-name=hvdtrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=hvdtrain-%j.out
set -euo pipefail

task=${1:-mnist}
if (($#)); then shift; fi
# sbatch runs a copy of this script from its spool directory: find the checkout from the
# directory the job was submitted from, not from the script's own path.
root=${HVDTRAIN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
python=${PYTHON:-$root/.venv/bin/python}
launcher=${LAUNCHER:-srun}
job=${SLURM_JOB_ID:-$(date +%Y%m%d-%H%M%S)}
run_dir=$root/runs/$task-$job
[[ -x "$python" ]] || { echo "slurm_job.sh: error: no $python (run scripts/setup.sh, or set PYTHON)" >&2; exit 2; }

# Network interface: the same one for every layer that opens sockets between nodes.
if [[ -n "${IFACE:-}" ]]; then
    export NCCL_SOCKET_IFNAME=$IFACE        # NCCL's bootstrap and TCP transport
    export HOROVOD_GLOO_IFACE=$IFACE        # Horovod's Gloo controller and allreduce
    export OMPI_MCA_btl_tcp_if_include=$IFACE OMPI_MCA_oob_tcp_if_include=$IFACE  # Open MPI
fi
# Quieter TensorFlow start-up; NCCL says which transport it chose at INFO.
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONUNBUFFERED=1  # lines appear in hvdtrain-JOBID.out as they are printed

case $launcher in
srun)
    # srun starts SLURM_NTASKS processes, forwards this whole environment (--export=ALL
    # is its default inside a job) and gives each its rank through PMIx; Horovod's MPI
    # controller reads them, so no mpirun and no ssh between nodes.
    # --cpu-bind=none: TensorFlow sizes its own thread pools per local rank.
    cmd=(srun --mpi="${SRUN_MPI:-pmix}" --cpu-bind=none --kill-on-bad-exit=1
         "$python" -m hvdtrain "$task" --run-dir "$run_dir" "$@")
    ;;
mpirun)
    # Open MPI's mpirun with a hostfile of the allocation: SLURM_JOB_NODELIST expanded by
    # scontrol, SLURM_NTASKS_PER_NODE slots each (e.g. "4" or "4(x2)"); launch_cluster.sh
    # forwards the environment with -x and applies IFACE to MPI, Gloo and NCCL.
    hostfile=$(mktemp "${TMPDIR:-/tmp}/hvdtrain-hosts.XXXXXX")
    trap 'rm -f "$hostfile"' EXIT
    slots=${SLURM_NTASKS_PER_NODE:-1}
    scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a SLURM allocation}" |
        sed "s/\$/ slots=${slots%%[(,]*}/" >"$hostfile"
    cmd=(env NP="${SLURM_NTASKS:?not inside a SLURM allocation}" PYTHON="$python"
         "$root/scripts/launch_cluster.sh" "$hostfile" "$task" --run-dir "$run_dir" "$@")
    ;;
*)
    echo "slurm_job.sh: error: LAUNCHER=$launcher: use srun or mpirun" >&2; exit 2 ;;
esac

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    if [[ -n "${hostfile:-}" ]]; then sed 's/^/hostfile: /' "$hostfile"; fi
    exit 0
fi
echo "slurm_job.sh: $task on ${SLURM_NTASKS:-?} processes, ${SLURM_JOB_NUM_NODES:-?} nodes; run dir $run_dir"
"${cmd[@]}"  # not exec: the EXIT trap removes the hostfile
