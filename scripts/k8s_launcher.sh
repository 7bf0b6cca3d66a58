#!/usr/bin/env bash
# The main process of an hvdtrain MPIJob launcher pod (deploy/kubernetes/), in the hvdtrain
# images: scripts/launch_cluster.sh (Open MPI's mpirun) over the hostfile the Kubeflow MPI
# Operator mounts, one rank per slot. Tested pod by pod in network namespaces:
# tests/clusters/test_k8s.py.
#
#   k8s_launcher.sh TASK [hvdtrain flags]     (--run-dir DIR on the job's claim: required)
#
# What it adds to mpirun:
# - It waits (HVDTRAIN_WAIT_WORKERS seconds, default 900) until every host of the hostfile
#   answers ssh: a retried launcher pod starts while a re-created worker may still be coming
#   up (a new node from the autoscaler, the image's pull), and ssh cannot retry a name the
#   cluster DNS does not know yet. A worker that Kubernetes left Failed (evicted), which the
#   operator never re-creates, is deleted through the API server meanwhile (scripts/k8s_pods.py,
#   with the launcher's Role in deploy/kubernetes/base), and the wait goes on for the new one.
# - A SIGTERM to it (the launcher pod deleted or evicted) goes on to the ranks over ssh
#   (scripts/k8s_worker.sh signal): every rank stops after the same step, rank 0 saves a
#   checkpoint and all exit 75, which is this script's status. mpirun itself never gets it
#   (a SIGTERM'd mpirun ends the job 1 or 143, without waiting for the checkpoint).
# - Exit statuses, for the launcher Job's retries (runPolicy.backoffLimit): the MPI Operator
#   retries every failed launcher pod alike (restart policy Never or OnFailure; it takes no
#   exit-code rules). hvdtrain's infrastructure statuses (69 a lost peer, 73 the run directory
#   still locked elsewhere, 74 a storage error, 75 preempted) and every status that is not
#   hvdtrain's (mpirun's own when it loses a node: 205, 255, or 1; 255 from ssh) are left to
#   those retries, which resume from the newest checkpoint. Only the user's mistakes are not: a status of
#   HVDTRAIN_PERMANENT_EXIT (default "1 2") that hvdtrain's ranks say they ended with (each
#   rank appends "rank R status S" to HVDTRAIN_EXIT_FILE, DIR/.hvdtrain-exit, which this script
#   empties before mpirun) would fail the same way again: the script writes
#   DIR/k8s-launcher-failed with the arguments, the status and the launcher Job's UID
#   (HVDTRAIN_LAUNCHER_JOB), and a retry of that Job with the same arguments prints it and
#   exits with that status at once, without starting mpirun. The Job controller still waits
#   before each retry (10 s, doubling, at most 6 min): 20 retries take about 95 minutes before
#   the MPIJob fails. A new MPIJob (a fixed image or data), or changed arguments (a fixed
#   flag, another --run-dir), run normally; so does deleting the file. A status while the pod
#   is being stopped (after a SIGTERM) never writes it.
#
# Environment: the operator's OMPI_MCA_orte_default_hostfile (the hostfile: /etc/mpi/hostfile),
# HVDTRAIN_WAIT_WORKERS, HVDTRAIN_API_EVERY and what k8s_pods.py takes (HVDTRAIN_K8S_API),
# and what launch_cluster.sh takes (IFACE, PYTHON, DRY_RUN; NP defaults to the hostfile's
# slots). The pod's variables reach the ranks only through launch_cluster.sh's -x list (they
# run under the workers' sshd, not in the launcher's environment); GLIBC_TUNABLES with
# glibc.malloc.hugetlb=1 is among them (launch_cluster.sh sets it; HVDTRAIN_HUGETLB=0: not).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
task=${1:?usage: k8s_launcher.sh TASK [hvdtrain flags] (with --run-dir on the claim)}
shift
hostfile=${OMPI_MCA_orte_default_hostfile:-/etc/mpi/hostfile}
[[ -r $hostfile ]] || { echo "k8s_launcher.sh: error: no hostfile $hostfile (not in an MPIJob launcher pod?)" >&2; exit 2; }

# The run directory, as hvdtrain reads the flags (python -m hvdtrain run-dir: empty if none).
python=${PYTHON:-$root/.venv/bin/python}
run_dir=$("$python" -m hvdtrain run-dir "$task" "$@")
if [[ -z $run_dir ]]; then
    echo "k8s_launcher.sh: error: give --run-dir on the job's claim: a restarted launcher resumes from its checkpoints" >&2
    exit 2
fi
# A claim this user cannot write (a root-squashed NFS export whose directory root owns, a
# read-only volume) fails every retry the same way: one line that says so, before anything.
if ! err=$(mkdir -p -- "$run_dir" 2>&1) || ! err=$(: 2>&1 >"$run_dir/.hvdtrain-write-test") \
        || ! rm -f -- "$run_dir/.hvdtrain-write-test"; then
    echo "k8s_launcher.sh: error: uid $(id -u) cannot write the run directory $run_dir (${err##*: }): the claim's files must be writable by the pods' user (an NFS export: its directory owned by uid $(id -u), or an access point with that uid); fix the claim, then delete the MPIJob and apply it again (each retry fails the same way)" >&2
    exit 2
fi
marker=$run_dir/k8s-launcher-failed
this_run=$(printf '%q ' "$task" "$@")
# The launcher Job's UID (the downward API: its pods' batch.kubernetes.io/controller-uid
# label): the Job's retries share it, a new MPIJob (a fixed image or fixed data, applied
# with the same arguments) has a new one and runs.
this_job="job ${HVDTRAIN_LAUNCHER_JOB:-?}"
if [[ -f $marker ]]; then
    if [[ $(sed -n 1p "$marker") == "$this_run" && $(sed -n 3p "$marker") == "$this_job" ]]; then
        status=$(sed -n 2p "$marker")
        echo "k8s_launcher.sh: not run again: the same command ended with status $status before (hvdtrain's own error), see $marker; change the command or delete that file" >&2
        sed -n '3,$p' "$marker" >&2
        exit "$status"
    fi
    rm -f "$marker"  # another command's, or another job's: this one runs
fi

mapfile -t hosts < <(awk 'NF && $1 !~ /^#/ {print $1}' "$hostfile")
np=$(awk 'NF && $1 !~ /^#/ {n = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) n = substr($i, 7); s += n} END {print s + 0}' "$hostfile")
echo "k8s_launcher.sh: $task on $np processes, ${#hosts[@]} workers (${hosts[*]}); run dir $run_dir"

# A worker that does not answer: is it Failed? The operator re-creates only missing workers;
# one the kubelet evicted (node pressure, its ephemeral-storage limit) or a graceful node
# shutdown stopped stays in phase Failed, out of the DNS, for good. scripts/k8s_pods.py asks
# the API server for that pod (at most once per worker every HVDTRAIN_API_EVERY s, 10) and
# deletes it if it is Failed, with the launcher's Role (get and delete on this job's worker
# pods, by name), so that the operator makes a new one. No service account token, or a 403
# (the account lacks the Role): said once, with the kubectl command, and not tried again; an
# API error: one line (again only if it changes), and the wait goes on.
api_off=0
declare -A api_checked=() api_said=()
check_worker() {
    local host=$1 out rc=0
    ((!api_off)) || return 0
    ((SECONDS - ${api_checked[$host]:--100000} >= ${HVDTRAIN_API_EVERY:-10})) || return 0
    api_checked[$host]=$SECONDS
    out=$(python3 "$root/scripts/k8s_pods.py" replace-failed "$host" 2>&1) || rc=$?
    ((rc != 3 && rc != 5)) || api_off=1
    if [[ -n $out && ($rc == 10 || ${api_said[$host]:-} != "$out") ]]; then
        echo "k8s_launcher.sh: $out" >&2
    fi
    api_said[$host]=$out
}

# Every worker's sshd answers: ssh retries a refused connection (the operator's
# OMPI_MCA_plm_rsh_args has ConnectionAttempts=10), not a name that does not resolve yet.
deadline=$((SECONDS + ${HVDTRAIN_WAIT_WORKERS:-900}))
for host in "${hosts[@]}"; do
    until ssh -o BatchMode=yes -o ConnectTimeout=5 "$host" true 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            echo "k8s_launcher.sh: error: $host does not answer ssh" >&2
            exit 255  # not hvdtrain's: left to the Job's retries
        fi
        check_worker "$host"
        sleep 2
    done
done

# A retry's workers may still run the ranks of the launcher before it (its pod or node gone,
# they train or save on): stopped and waited for first, so that this launcher's rank 0 does
# not find the run directory held by them.
for host in "${hosts[@]}"; do
    ssh -o BatchMode=yes -o ConnectTimeout=5 "$host" "$root/scripts/k8s_worker.sh" drain \
        </dev/null &
done
wait

stopping=0
# shellcheck disable=SC2317  # invoked by the trap below
pass_term() {
    stopping=1
    echo "k8s_launcher.sh: SIGTERM: passing it to the ranks" >&2
    local host
    for host in "${hosts[@]}"; do  # in the background: the trap returns at once
        ssh -o BatchMode=yes -o ConnectTimeout=5 "$host" "$root/scripts/k8s_worker.sh" signal TERM \
            </dev/null >/dev/null 2>&1 &
    done
}

# hvdtrain's ranks say here which statuses are theirs (the user's mistakes); see above.
export HVDTRAIN_EXIT_FILE=$run_dir/.hvdtrain-exit
: >"$HVDTRAIN_EXIT_FILE"
NP=${NP:-$np} "$root/scripts/launch_cluster.sh" "$hostfile" "$task" "$@" &
launched=$!
trap pass_term TERM
status=0
wait "$launched" || status=$?
while kill -0 "$launched" 2>/dev/null; do  # the trap ended the wait, not mpirun
    status=0
    wait "$launched" || status=$?
done
trap - TERM
if ((!stopping)); then
    for code in ${HVDTRAIN_PERMANENT_EXIT:-1 2}; do
        if ((status == code)) && grep -q " status $status\$" "$HVDTRAIN_EXIT_FILE" 2>/dev/null; then
            { echo "$this_run"; echo "$status"; echo "$this_job"
              date -u "+ended %Y-%m-%dT%H:%M:%SZ in pod ${HOSTNAME:-?}"; } >"$marker"
            echo "k8s_launcher.sh: status $status is hvdtrain's own error: retries of this command will not run it again ($marker)" >&2
        fi
    done
    if [[ $status != 0 && ! -f $marker ]]; then
        echo "k8s_launcher.sh: status $status is the infrastructure's (not the command's): left to the retries, which resume from the newest checkpoint" >&2
    fi
fi
exit "$status"
