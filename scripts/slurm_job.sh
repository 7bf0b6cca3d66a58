#!/usr/bin/env bash
# hvdtrain as a SLURM batch job: srun (or mpirun) starts one process per task on every node.
# Tested under SLURM 22.05 (Debian's slurmctld/slurmd, two nodes): tests/clusters/test_slurm.py.
#
#   sbatch scripts/slurm_job.sh                                   # MNIST, 2 nodes x 1 task
#   sbatch scripts/slurm_job.sh linear --epochs 5                 # TASK and hvdtrain flags
#   sbatch --nodes=4 --ntasks-per-node=4 --gpus-per-node=4 scripts/slurm_job.sh mnist
#   sbatch --export=ALL,LAUNCHER=mpirun,IFACE=ib0 scripts/slurm_job.sh linear
#   sbatch --test-only [same flags] scripts/slurm_job.sh ...      # refused now, or queued
#
# TASK: linear, mnist (default) or package.module:TaskClass; the rest are its flags.
# Run directory: runs/JOBNAME-TASK under the submit directory (JOBNAME is sbatch's --job-name,
# default hvdtrain), unless the flags give --run-dir. It does not depend on the job id, so
# submitting the same command again resumes from the newest checkpoint, as does `scontrol
# requeue`; give each experiment its own --job-name (or --run-dir).
# Exit status: hvdtrain's; 75 after a SIGTERM: every rank stopped at the same step and rank 0
# saved a checkpoint; submit again to resume. Send it with `scancel --batch --signal=TERM
# JOBID`: this script passes it to the ranks (either launcher). A plain `scancel --signal=TERM`
# also stops them with a checkpoint, but SLURM then cancels the step: under srun the job can
# end 143 (srun "Force Terminated" a rank still exiting), under mpirun 205 (its daemons exit).
#
# Environment (sbatch passes the submitting shell's environment by default):
#   HVDTRAIN_ROOT=DIR  the checkout, the same path on every node (default: the submit
#                      directory, i.e. submit from the checkout's root)
#   PYTHON=...         the interpreter on every node (default: HVDTRAIN_ROOT/.venv/bin/python)
#   LAUNCHER=srun      srun (default): SLURM starts the tasks and gives them their ranks through
#                      its PMIx plugin (Open MPI built with PMIx, e.g. Debian's); or mpirun:
#                      Open MPI's mpirun over a hostfile of the allocation, via
#                      scripts/launch_cluster.sh (mpirun then starts its daemons through srun)
#   SRUN_MPI=pmix      srun's --mpi plugin (`srun --mpi=list`; pmix_v4 etc. also work; pmi2
#                      does not with Debian's Open MPI: "OMPI was not built with SLURM's PMI")
#   SLURM_WAIT=60      (srun) seconds srun lets the other tasks run on after the first one
#                      ended before it ends them (Slurm's own variable for srun --wait; 0:
#                      for ever). A rank that dies before it joins the others (at import,
#                      before hvd.init) would otherwise leave them waiting in MPI's start
#                      until the job's time limit. hvdtrain's ranks otherwise end together
#                      (the end, a preemption), or its watchdog ends them within its
#                      peer_timeout (30 s): keep SLURM_WAIT above a larger peer_timeout.
#   IFACE=ib0          the network interface between nodes, for MPI, Gloo and NCCL
#   DRY_RUN=1          print the launch command instead of running it
#   TF_CPP_MIN_LOG_LEVEL=2, NCCL_DEBUG=WARN   TensorFlow's and NCCL's log levels (defaults)
#   HVDTRAIN_HUGETLB=0 leave GLIBC_TUNABLES alone (default: glibc.malloc.hugetlb=1 added where
#                      the node's glibc and transparent huge pages allow, scripts/hugetlb.sh)
#
# Resources: the #SBATCH lines below ask for 2 nodes, 1 task (process) each with 2 CPUs, no
# GPU; sbatch's own flags override them. GPU nodes: one task per GPU, and ask for the GPUs,
# e.g. --ntasks-per-node=4 --gpus-per-node=4 (or --gres=gpu:4): every task of a node then
# sees all of its GPUs and hvdtrain pins GPU number = local rank. Some requests the nodes
# cannot hold are not refused by sbatch but left PENDING until cancelled (more CPUs per task
# than a node has, or more nodes than the partition: reason PartitionConfig or
# PartitionNodeLimit).
# This script cannot see that, since it only runs once the job starts: `sbatch --test-only
# ...` prints one line for it instead ("allocation failure: Requested node configuration is
# not available").
#SBATCH --job-name=hvdtrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=01:00:00
#SBATCH --output=hvdtrain-%j.out
set -euo pipefail

task=${1:-mnist}
if (($#)); then shift; fi
# sbatch runs a copy of this script from its spool directory: the checkout is named by
# HVDTRAIN_ROOT or is the directory the job was submitted from, not the script's own path.
submit_dir=${SLURM_SUBMIT_DIR:-$PWD}
root=${HVDTRAIN_ROOT:-$submit_dir}
python=${PYTHON:-$root/.venv/bin/python}
launcher=${LAUNCHER:-srun}
[[ -x "$python" ]] || { echo "slurm_job.sh: error: no $python (run scripts/setup.sh, or set PYTHON or HVDTRAIN_ROOT)" >&2; exit 2; }

# The run directory, as hvdtrain reads the flags (python -m hvdtrain run-dir): their --run-dir,
# else one under the submit directory named after the job name and the task, so that the
# same submission finds its checkpoints again.
run_dir=$("$python" -m hvdtrain run-dir "$task" "$@")
if [[ -z "$run_dir" ]]; then
    job=${SLURM_JOB_NAME:-hvdtrain}
    run_dir=$(cd "$submit_dir" && "$python" -m hvdtrain run-dir --job "$job" "$task")
    set -- --run-dir "$run_dir" "$@"
fi

# Network interface: the same one for every layer that opens sockets between nodes.
if [[ -n "${IFACE:-}" ]]; then
    export NCCL_SOCKET_IFNAME=$IFACE        # NCCL's bootstrap and TCP transport
    export HOROVOD_GLOO_IFACE=$IFACE        # Horovod's Gloo controller and allreduce
    export OMPI_MCA_btl_tcp_if_include=$IFACE OMPI_MCA_oob_tcp_if_include=$IFACE  # Open MPI
fi
# Quieter TensorFlow start-up; NCCL says which transport it chose at INFO.
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTHONUNBUFFERED=1  # lines appear in hvdtrain-JOBID.out as they are printed
# TensorFlow's buffers on huge pages: GLIBC_TUNABLES, read by glibc when each rank starts.
# The checkout's copy (sbatch runs this script from its spool directory), else the one beside
# this script when it runs in place.
# shellcheck disable=SC1091  # scripts/hugetlb.sh, linted on its own
source "$root/scripts/hugetlb.sh" 2>/dev/null || source "$(dirname "${BASH_SOURCE[0]}")/hugetlb.sh"
hvdtrain_hugetlb

case $launcher in
srun)
    # srun starts SLURM_NTASKS processes, forwards this whole environment (--export=ALL
    # is its default inside a job) and gives each its rank through PMIx; Horovod's MPI
    # controller reads them, so no mpirun and no ssh between nodes.
    # --kill-on-bad-exit=0 (also over a KillOnBadExit=1 in slurm.conf): after a SIGTERM every
    # rank exits 75 at its own pace, and srun must not kill the slower ones (the job would end
    # 143); a rank that dies is caught by hvdtrain's peer watchdog, which stops the others.
    # --cpu-bind=none: TensorFlow sizes its own thread pools per local rank.
    # --wait: SLURM_WAIT above (a rank dead before hvd.init, where no watchdog sees it).
    cmd=(srun --mpi="${SRUN_MPI:-pmix}" --cpu-bind=none --kill-on-bad-exit=0
         --wait="${SLURM_WAIT:-60}"
         "$python" -m hvdtrain "$task" "$@")
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
         "$root/scripts/launch_cluster.sh" "$hostfile" "$task" "$@")
    ;;
*)
    echo "slurm_job.sh: error: LAUNCHER=$launcher: use srun or mpirun" >&2; exit 2 ;;
esac

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    if [[ -n "${hostfile:-}" ]]; then sed 's/^/hostfile: /' "$hostfile"; fi
    exit 0
fi
echo "slurm_job.sh: $task on ${SLURM_NTASKS:-?} processes, ${SLURM_JOB_NUM_NODES:-?} nodes" \
     "(${SLURM_JOB_NODELIST:-?}), $launcher; GPUs per node: ${SLURM_GPUS_ON_NODE:-none};" \
     "run dir $run_dir"
# A SIGTERM to this shell (`scancel --batch --signal=TERM`) goes on to the ranks, not to the
# launcher: srun and mpirun end the whole step on a SIGTERM of their own (the job would end 137
# or 1, not 75). One rank's SIGTERM stops every rank at the same step, so this node's ranks
# (srun's tasks or mpirun's local processes: a rank variable and this job's id in their
# environment) are enough; rank 0 saves and each exits 75.
# shellcheck disable=SC2317  # invoked by the trap below
pass_term() {
    local environ vars
    termed=1
    for environ in /proc/[0-9]*/environ; do
        vars=$(tr '\0' '\n' 2>/dev/null <"$environ") || continue
        if grep -qx "SLURM_JOB_ID=$SLURM_JOB_ID" <<<"$vars" &&
                grep -qE '^(PMIX_RANK|OMPI_COMM_WORLD_RANK)=' <<<"$vars"; then
            environ=${environ#/proc/}
            kill -TERM "${environ%/environ}" 2>/dev/null || true
        fi
    done
}
# In the background, so that the trap runs at once rather than after the launcher ends.
"${cmd[@]}" &
launched=$!
termed=0
trap pass_term TERM
status=0
wait "$launched" || status=$?
# The trap ended the wait (143), not the launcher: wait again for the launcher's own status,
# which the shell keeps if it has exited meanwhile (the ranks exit 75 while the trap still
# walks /proc; checking whether it still runs lost that status on a busy node: 143).
while [[ $termed == 1 ]]; do
    termed=0 status=0
    wait "$launched" || status=$?
done
exit "$status"
