#!/usr/bin/env bash
# The main process (PID 1) of an hvdtrain MPIJob worker pod (deploy/kubernetes/), in the
# hvdtrain images: Debian's sshd, which the launcher's mpirun reaches to start its daemon
# (orted) and this pod's ranks, and the SIGTERM that Kubernetes sends to a pod's PID 1 (pod
# deletion, node drain, preemption, a suspended MPIJob) passed on to those ranks.
# Tested pod by pod in network namespaces: tests/clusters/test_k8s.py.
#
#   k8s_worker.sh [sshd flags]     the container's command: sshd -De -f
#                                  /etc/ssh/hvdtrain/sshd_config (port 2222) [flags]
#   k8s_worker.sh signal [SIG]     send SIG (default TERM) to this pod's ranks (the launcher
#                                  runs this over ssh when its own pod gets the SIGTERM)
#   k8s_worker.sh drain            a retried launcher, before its mpirun: ranks of an earlier
#                                  launcher still alive in this pod (its pod or node gone,
#                                  they train or save on) get the SIGTERM and are waited for
#                                  (HVDTRAIN_DRAIN_WAIT, 100 s; then SIGKILL), so that the new
#                                  rank 0 does not find the run directory held by the old one
#   k8s_worker.sh probe            the readiness probe: an ssh login here with the job's key
#                                  runs a command (what the launcher's mpirun needs; an open
#                                  port proves nothing: an sshd that cannot chroot or read its
#                                  keys still accepts connections, then fails every login).
#                                  Once one login has worked, sshd still running is enough:
#                                  a login every periodSeconds would log two lines each time
#
# sshd runs as the pod's user (the image's mpiuser, or root) without any capability. The
# job's key pair is at HVDTRAIN_SSH_DIR (default ~/.ssh, the MPIJob's sshAuthMountPath): its
# private key is also sshd's host key (the image has none); without it, a host key is made
# when the worker starts.
#
# Only PID 1 gets the SIGTERM; when it exits, every other process of the pod is killed. sshd
# alone (the operator's default command) would exit at once and take the ranks with it, before
# any checkpoint. This script instead gives the ranks the SIGTERM (one rank's is enough: every
# rank stops after the same step, rank 0 saves a checkpoint, all exit 75), waits for them and
# then for orted (so that mpirun hears the 75s), and only then stops sshd. The pod's
# terminationGracePeriodSeconds bounds it all: Kubernetes kills what is left after that.
#
# Environment: HVDTRAIN_ORTED_WAIT=15  seconds to wait for orted after the ranks have exited.
set -uo pipefail

# This pod's ranks: the processes Open MPI's orted started (they carry their rank in their
# environment). Nothing else in the container has it.
ranks() {
    local environ pid
    for environ in /proc/[0-9]*/environ; do
        pid=${environ#/proc/}
        pid=${pid%/environ}
        if [[ $pid != "$$" ]] && grep -qz '^OMPI_COMM_WORLD_RANK=' "$environ" 2>/dev/null; then
            echo "$pid"
        fi
    done
}

running() {  # any of the processes named on the command line still there (zombies aside)?
    local pid state
    for pid in "$@"; do
        state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || continue
        [[ -n $state && $state != Z ]] && return 0
    done
    return 1
}

ssh_dir=${HVDTRAIN_SSH_DIR:-$HOME/.ssh}
# sshd's pid (written at its start), and the same once a probe's login has worked: the
# container's own /tmp, new with each container.
sshd_pid=${TMPDIR:-/tmp}/hvdtrain-sshd.pid
logged_in=${TMPDIR:-/tmp}/hvdtrain-sshd.ready
if [[ ${1:-} == probe ]]; then
    if [[ -s $logged_in ]] && running "$(cat "$logged_in")"; then
        exit 0
    fi
    ssh -p 2222 -o BatchMode=yes -o ConnectTimeout=5 -o StrictHostKeyChecking=no \
        -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -i "$ssh_dir/id_rsa" localhost true \
        || exit 1
    if [[ -s $sshd_pid ]]; then cp "$sshd_pid" "$logged_in"; fi
    exit 0
fi

if [[ ${1:-} == drain ]]; then
    pids=$(ranks)
    [[ -z $pids ]] && exit 0
    # shellcheck disable=SC2086  # one pid per word
    echo "k8s_worker.sh: ${HOSTNAME:-?}: an earlier launcher's ranks still run here:" \
        "stopping them (pids" $pids")" >&2
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null
    for ((i = 0; i < ${HVDTRAIN_DRAIN_WAIT:-100} * 5; i++)); do
        pids=$(ranks)
        [[ -z $pids ]] && break
        sleep 0.2
    done
    if [[ -n $pids ]]; then
        echo "k8s_worker.sh: ${HOSTNAME:-?}: ranks still running after" \
            "${HVDTRAIN_DRAIN_WAIT:-100} s: killed" >&2
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null
    fi
    # The earlier job's daemon(s), waited for (10 s, then SIGKILL): one still exiting removes
    # its part of the pod's Open MPI session directory (/tmp/ompi.HOST.UID) while the next
    # mpirun's daemon starts there, and that job's ranks fail in MPI_Init.
    if orted=$(pgrep -x orted); then
        # shellcheck disable=SC2086  # one pid per word
        kill -TERM $orted 2>/dev/null
        for ((i = 0; i < 50; i++)); do
            # shellcheck disable=SC2086
            running $orted || break
            sleep 0.2
        done
        # shellcheck disable=SC2086
        running $orted && kill -KILL $orted 2>/dev/null
    fi
    exit 0
fi

if [[ ${1:-} == signal ]]; then
    pids=$(ranks)
    [[ -z $pids ]] && exit 0
    # shellcheck disable=SC2086  # one pid per word
    exec kill -s "${2:-TERM}" $pids
fi

if [[ $(id -u) == 0 ]]; then
    mkdir -p /run/sshd  # root's sshd: its privilege separation directory (/run: a fresh tmpfs)
fi
host_key=$ssh_dir/id_rsa
if [[ ! -r $host_key ]]; then
    # No job key (a container started outside an MPIJob, with its own authorized_keys): a host
    # key of this worker's own, made now, never the image's.
    host_key=$(mktemp -d)/ssh_host_ed25519_key
    ssh-keygen -q -t ed25519 -N "" -f "$host_key" || exit 1
    echo "k8s_worker.sh: no key at $ssh_dir/id_rsa: sshd uses a host key made now ($host_key)" >&2
fi
/usr/sbin/sshd -De -f /etc/ssh/hvdtrain/sshd_config -o "HostKey=$host_key" "$@" &
sshd=$!
rm -f "$logged_in"
echo "$sshd" >"$sshd_pid"

stopping=0
# shellcheck disable=SC2317  # invoked by the trap below
on_term() {
    stopping=1
    local pids
    pids=$(ranks)
    echo "k8s_worker.sh: SIGTERM: passing it to this pod's ranks (${pids:-none})" >&2
    # shellcheck disable=SC2086
    [[ -n $pids ]] && kill -TERM $pids 2>/dev/null
}
trap on_term TERM

status=0
while :; do
    wait "$sshd"
    status=$?
    if ((stopping)) || ! running "$sshd"; then break; fi
done
if ! ((stopping)); then
    exit "$status"  # sshd ended by itself: the restart policy (OnFailure) restarts the pod
fi

# The ranks save and exit; then orted reports their status to mpirun and exits when mpirun
# tells it to. Kubernetes' grace period bounds the first wait.
while pids=$(ranks) && [[ -n $pids ]]; do sleep 0.2; done
for ((i = 0; i < ${HVDTRAIN_ORTED_WAIT:-15} * 5; i++)); do
    orted=$(pgrep -x orted) || break
    # shellcheck disable=SC2086  # one pid per word
    running $orted || break
    sleep 0.2
done
kill -TERM "$sshd" 2>/dev/null
wait "$sshd" 2>/dev/null
echo "k8s_worker.sh: this pod's ranks have exited; stopping" >&2
exit 0
