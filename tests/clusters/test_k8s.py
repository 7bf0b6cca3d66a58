"""deploy/kubernetes/'s smoke MPIJob emulated pod by pod (tests/k8s_cluster.py); the offline
checks of the manifests are tests/clusters/test_k8s_manifests.py, the guide's commands
tests/clusters/test_k8s_guide.py.

The emulation (tests/k8s_cluster.py): the smoke overlay's MPIJob on three workers, pod by pod
in network, UTS, PID and mount namespaces: a launcher and three workers with the operator's
host names, hostfile, environment and ssh key pair, every process as the image's mpiuser with
no capability (the pods' securityContext), the image's sshd configuration (port 2222, the
job's key as host key) in each worker (scripts/k8s_worker.sh), ready once an ssh login works,
each worker's daemon started over ssh by the one before it (Open MPI's tree spawn as a chain),
the launcher running the MPIJob's exact command (scripts/k8s_launcher.sh). The job trains with
identical ranks; deleting every pod (SIGTERM to each PID 1) ends it 75 with a checkpoint on the
claim, and a new set of pods resumes from it to the uninterrupted run's weights; rank 0's
worker killed with SIGKILL ends it with a retried status, and the next pods wait out the run
directory's lock held on (a dead node's NFS lease) and resume to the same weights; a job that
ends with hvdtrain's exit 2 is not run again by the next launcher pod; a worker evicted mid-run
(left Failed, which the operator never replaces) is deleted through the API server by the next
launcher pod, re-created, and the job resumes to the same weights; without the launcher's Role
or token, one line names the kubectl command instead.

Cost (two cores shared with other test runs, so noisy): the emulation 6 to 6.5 min (the uninterrupted run 77-90 s, the deletion and resume 105-165 s, the
node crash and resume 115-140 s, the permanent error 8-11 s), against 1.5 min for the two-worker
emulation before it had the three workers, the crash and the non-root pods. A later run, beside
another engineer's wheel build: 5.2 min in all, of which the eviction and resume 31-34 s and
the two checks without the Role 15-16 s each (about 1.1 min added for them).
"""

import copy
import fcntl
import glob
import json
import os
import re
import threading
import time

import pytest

import k8s_manifests as K
import rank_env
from docs_pages import block

pytestmark = pytest.mark.k8s


# --- the emulation ------------------------------------------------------------------------------
# What the guide's first command of a run applies (`kubectl apply -k .../overlays/smoke`): the
# MPIJob the emulation runs.
APPLIED = K.applied(
    block(
        "guides/clusters/kubernetes.md", "kubectl apply -k deploy/kubernetes/overlays/smoke "
    ).commands()[0]
)
SMOKE = K.mpijob(APPLIED)
RBAC = [d for d in APPLIED if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
RUN_DIR = K.containers(SMOKE, "Launcher")[0]["args"][2]  # --run-dir's value
GRACE = 60  # the test's bound on a pod's termination (the manifest's 120 s)


def three_workers(job, epochs=4):
    """The smoke job on 3 workers, each daemon started by the one before (Open MPI's tree
    spawn with radix 1: the worker-to-worker ssh that jobs of more than 64 workers do), for
    ``epochs`` epochs instead of 10 (two cores run the three ranks)."""
    job = copy.deepcopy(job)
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 3
    args = K.containers(job, "Launcher")[0]["args"]
    args[args.index("--epochs") + 1] = str(epochs)
    K.containers(job, "Launcher")[0].setdefault("env", []).append(
        {"name": "OMPI_MCA_routed_radix", "value": "1"}
    )
    return job


JOB = three_workers(SMOKE)
WORKERS = 3
STEPS = 264  # 4 epochs of 66 steps (5 examples per rank and step, 1,000 examples, 3 ranks)


@pytest.fixture(scope="module")
def cluster():
    from k8s_cluster import Network

    net = Network(f"hk{os.getpid() % 100000}")
    try:
        yield net.create()
    finally:
        net.destroy()  # and checks that no namespace or process of it is left


def on_claim(claim):
    return claim / os.path.relpath(RUN_DIR, K.RUNS)


def checkpoint_steps(run_dir):
    return sorted(
        (
            int(re.search(r"ckpt-(\d+)\.hvdt$", p).group(1))
            for p in glob.glob(os.path.join(run_dir, "checkpoints", "ckpt-*.hvdt"))
        ),
        reverse=True,
    )


def result(run_dir):
    with open(os.path.join(run_dir, "result.json")) as f:
        return json.load(f)


def rbac_for(job):
    """The smoke overlay's ServiceAccount, Role and RoleBinding, the Role's names those of
    ``job``'s workers (as a user edits them for another number of workers)."""
    rbac = copy.deepcopy(RBAC)
    for d in rbac:
        if d["kind"] == "Role":
            d["rules"][0]["resourceNames"] = K.worker_names(job)
    assert K.rbac_errors(rbac + [job]) == []
    return rbac


def job_run(cluster, base, claim, job=SMOKE, job_uid=None, rbac=None):
    """The pods of ``job``'s launcher Job ``job_uid`` (a retry: the first run's; None: new),
    with the launcher's service account and Role (``rbac``; None: the overlay's, for ``job``'s
    workers)."""
    from k8s_cluster import JobRun

    return JobRun(
        cluster,
        base,
        job,
        {"hvdtrain-runs": claim},
        job_uid=job_uid,
        rbac=rbac_for(job) if rbac is None else rbac,
    )


def launcher_argv(run, timeout=10):
    """The command line of the launcher pod's PID 1 once the pod's setup has exec'd it (the
    script's interpreter, bash, and its arguments)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = run.launcher.pid1()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0")[:-1]]
        except OSError:
            argv = []
        if argv and os.path.basename(argv[0]) == "bash":
            return argv
        time.sleep(0.02)
    pytest.fail(f"no launcher process after {timeout}s\n{run.logs()}")


def finish(run, timeout=120):
    rc = run.launcher.wait(timeout)
    assert rc is not None, f"launcher still running after {timeout}s\n{run.logs()}"
    return rc


def run_again(cluster, tmp_path, claim, timeout, job_uid):
    """The next set of pods in tmp_path/pods-again (the same claim and command; the launcher
    Job ``job_uid``'s retry), run to the launcher's end and deleted: (its status, the pods'
    logs)."""
    again = job_run(cluster, tmp_path / "pods-again", claim, JOB, job_uid)
    try:
        again.start()
        rc = finish(again, timeout)
        again.delete(GRACE)
    finally:
        again.remove()
    return rc, again.logs()


def check_trained(r):
    assert (r["world_size"], r["backend"], r["ranks_identical"]) == (WORKERS, "horovod", True)
    assert r["global_step"] == STEPS


def wait_for_checkpoint(run, run_dir, timeout=120):
    deadline = time.monotonic() + timeout
    while not checkpoint_steps(run_dir):
        assert run.launcher.proc.poll() is None, run.logs()
        assert time.monotonic() < deadline, f"no checkpoint in {timeout} s\n{run.logs()}"
        time.sleep(0.1)


def credentials(pid):
    """Uid and the capability sets of a process, from /proc/PID/status."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    return (
        fields["Uid"].split()[0],
        int(fields["CapEff"], 16),
        int(fields["CapBnd"], 16),
        fields["NoNewPrivs"],
    )


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """The smoke MPIJob from start to end: what the preempted one must reproduce."""
    base = tmp_path_factory.mktemp("k8s-uninterrupted")
    claim = base / "claim"
    claim.mkdir()
    # Each rank's GLIBC_TUNABLES at its start, logged on the claim (rank_env): PYTHONPATH in the
    # launcher pod's env reaches the ranks as the rest of it does, through launch_cluster.sh.
    job = copy.deepcopy(JOB)
    K.containers(job, "Launcher")[0].setdefault("env", []).append(
        {"name": "PYTHONPATH", "value": rank_env.install(claim, K.RUNS)}
    )
    t = time.monotonic()
    run = job_run(cluster, base / "pods", claim, job)
    try:
        run.start()
        # PID 1 of the launcher pod is the MPIJob's command and args, exactly.
        cmd = K.containers(job, "Launcher")[0]
        assert launcher_argv(run)[-len(cmd["args"]) - 1 :] == cmd["command"] + cmd["args"]
        creds = {p.name: credentials(p.pid1()) for p in run.pods.values()}
        # The kubelet probes on while the job runs: three more rounds of every worker's probe.
        probed = [w.ready() for w in run.workers for _ in range(3)]
        addresses = {name: cluster.hosts[name][1] for name in run.pods}
        rc = finish(run, 240)
        logs = run.logs()
        statuses = run.delete(GRACE)
    finally:
        run.remove()
    return {
        "rc": rc,
        "logs": logs,
        "statuses": statuses,
        "result": result(on_claim(claim)),
        "seconds": time.monotonic() - t,
        "run": run,
        "creds": creds,
        "addresses": addresses,
        "owner": os.stat(on_claim(claim) / "result.json").st_uid,
        "starts": rank_env.starts(claim),
        "probed": probed,
    }


@pytest.mark.timeout(600)  # its fixtures start the pods' daemons
def test_k8s_emulated_mpijob_trains_with_identical_ranks(uninterrupted):
    u, run = uninterrupted, uninterrupted["run"]
    assert u["rc"] == 0, u["logs"]
    check_trained(u["result"])
    # The operator's hostfile, its variables, a launch over ssh with its key pair to each worker.
    launcher = run.launcher.log()
    hosts = [f"hvdtrain-smoke-worker-{i}.hvdtrain-smoke.default.svc" for i in range(WORKERS)]
    assert run.objects["hostfile"] == "".join(f"{h} slots=1\n" for h in hosts)
    assert (
        f"k8s_launcher.sh: linear on 3 processes, 3 workers ({' '.join(hosts)}); run dir {RUN_DIR}"
    ) in launcher, launcher
    # Every pod as the image's mpiuser, with no capability and none to regain (no
    # CAP_SYS_CHROOT: CRI-O's default set drops it, drop: [ALL] drops the rest), and the
    # ranks' files on the claim are mpiuser's.
    assert set(u["creds"].values()) == {("1000", 0, 0, "1")}, u["creds"]
    assert u["owner"] == 1000
    env = {e["name"]: e.get("value") for e in run.launcher.container["env"]}
    assert env["OMPI_MCA_orte_default_hostfile"] == "/etc/mpi/hostfile"
    assert env["OMPI_MCA_plm_rsh_args"] == "-o ConnectionAttempts=10"
    # sshd on port 2222 with the job's key as its host key; each worker's daemon reached
    # over ssh, worker-0's from the launcher, the others' from the worker before it.
    for w in run.workers:
        assert "Server listening on 0.0.0.0 port 2222" in w.log(), w.log()
        assert "Accepted publickey for mpiuser" in w.log(), w.log()
    for i, w in enumerate(run.workers):
        ip = u["addresses"][run.launcher.name if i == 0 else run.workers[i - 1].name]
        assert f"Accepted publickey for mpiuser from {ip} " in w.log(), (i, w.log())
    # The readiness probe logs in once (the first success); later probes, ready all along,
    # only see that sshd runs: no two lines in the pod's log every periodSeconds.
    assert all(u["probed"]), u["probed"]
    for w in run.workers:
        logins = re.findall(r"Accepted publickey for mpiuser from (127\.0\.0\.1|::1) ", w.log())
        assert len(logins) == 1, w.log()
    # Deleting the finished job's workers: each stops at once, with nothing to pass on.
    assert [u["statuses"][w.name] for w in run.workers] == [0] * WORKERS, u["logs"]
    # Every rank, in its worker pod, started once with glibc's huge-page tunable, which
    # k8s_launcher.sh's launch_cluster.sh set in the launcher pod and forwarded (-x).
    expected = rank_env.expected()
    assert len(u["starts"]) == WORKERS, u["starts"]
    assert all(v == [expected] for v in u["starts"].values()), u["starts"]


@pytest.mark.timeout(600)  # its fixtures start the pods' daemons
def test_k8s_emulated_pod_deletion_gives_75_then_new_pods_resume(cluster, uninterrupted, tmp_path):
    claim = tmp_path / "claim"
    claim.mkdir()
    run_dir = on_claim(claim)
    run = job_run(cluster, tmp_path / "pods", claim, JOB)
    try:
        run.start()
        wait_for_checkpoint(run, run_dir)
        statuses = run.delete(GRACE)  # SIGTERM to every pod's PID 1, as a deletion sends it
    finally:
        run.remove()
    logs = run.logs()
    assert statuses[run.launcher.name] == 75, logs
    assert [statuses[w.name] for w in run.workers] == [0] * WORKERS, logs
    stopped = re.findall(r"stopped by SIGTERM at step (\d+); checkpoint saved", logs)
    assert stopped and len(set(stopped)) == 1, logs  # every rank at the same step
    step = int(stopped[0])
    assert 0 < step < STEPS and checkpoint_steps(run_dir)[0] == step
    assert not (run_dir / "result.json").exists()
    for w in run.workers:
        assert "passing it to this pod's ranks" in w.log(), w.log()

    # The next set of pods (new addresses, new key pair, the same claim and command).
    rc, logs = run_again(cluster, tmp_path, claim, 240, run.job_uid)
    assert rc == 0, logs
    assert f"ckpt-{step:09d}.hvdt at epoch" in logs, logs  # resumed from the SIGTERM's checkpoint
    r = result(run_dir)
    check_trained(r)
    assert r["weights_sha256"] == uninterrupted["result"]["weights_sha256"]


class Lease(threading.Thread):
    """A crashed node's lock on a network file system: the server keeps it for the node's
    lease (NFSv4: 90 s) after the node is gone. Here: the run directory's flock, taken the
    moment the dead holder's own lock goes and held (the file's holder lines untouched)
    until ``until()`` is true, or ``most`` seconds."""

    def __init__(self, path, until, most=120):
        super().__init__(daemon=True)
        self.fd = os.open(path, os.O_RDWR)
        deadline = time.monotonic() + 10
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the killed holder's lock stayed"
                time.sleep(0.05)
        self.until, self.most, self.held = until, most, None
        self.start()

    def run(self):
        t = time.monotonic()
        while not self.until() and time.monotonic() - t < self.most:
            time.sleep(0.2)
        time.sleep(1)  # the waiting run sees it held at least once more
        self.held = time.monotonic() - t
        os.close(self.fd)


@pytest.mark.timeout(600)  # its fixtures start the pods' daemons
def test_k8s_emulated_launcher_replaced_while_its_ranks_run_resumes(
    cluster, uninterrupted, tmp_path
):
    """The launcher's node dies; its ranks, on the workers, train on (nothing tells them);
    the Job's next launcher pod stops them first (each saves at a shared step and exits, not
    waiting for its gone mpirun), then resumes: no RunDirBusy taken for the user's mistake,
    the uninterrupted weights."""
    claim = tmp_path / "claim"
    claim.mkdir()
    run_dir = on_claim(claim)
    run = job_run(cluster, tmp_path / "pods", claim, JOB)
    try:
        run.start()
        wait_for_checkpoint(run, run_dir)
        old = run.replace_launcher()
        rc = finish(run, 240)
        logs = old.log() + run.logs()
        run.delete(GRACE)
    finally:
        run.remove()
    assert rc == 0, logs
    assert "an earlier launcher's ranks still run here: stopping them" in logs, logs
    # ... and they stopped: saved, then exited without waiting for their gone mpirun's MPI
    # shutdown (FINALIZE_WAIT), not killed at the end of the drain's 100 s.
    assert "ranks still running after" not in logs, logs
    # The old ranks' own lines went to their dead mpirun; the new ones resumed from a checkpoint.
    assert "resumed from" in run.launcher.log(), logs
    assert not (run_dir / "k8s-launcher-failed").exists(), logs
    r = result(run_dir)
    check_trained(r)
    assert r["weights_sha256"] == uninterrupted["result"]["weights_sha256"]


@pytest.mark.timeout(900)  # its fixtures start the pods' daemons
def test_k8s_emulated_node_crash_is_retried_and_resumes(cluster, uninterrupted, tmp_path):
    """worker-0 (rank 0's pod) killed with SIGKILL, as a node crash ends it: no SIGTERM, no
    checkpoint. The launcher ends with a status the retries take (not hvdtrain's own 1, not
    a "failed" marker); the run directory's lock stays held as a file server keeps a dead
    node's, and the next set of pods waits for it, then resumes from the last periodic
    checkpoint to the uninterrupted run's weights."""
    claim = tmp_path / "claim"
    claim.mkdir()
    run_dir = on_claim(claim)
    run = job_run(cluster, tmp_path / "pods", claim, JOB)
    lease = None
    try:
        run.start()
        wait_for_checkpoint(run, run_dir)
        crashed = run.workers[0]
        holder = (run_dir / ".lock").read_text().splitlines()[0]
        assert holder.startswith("pid ") and " on hvdtrain-smoke-worker-0 since " in holder
        crashed.kill()  # SIGKILL to the pod's every process, as the node's end
        again_log = tmp_path / "pods-again" / "hvdtrain-smoke-launcher" / "log"
        lease = Lease(
            run_dir / ".lock",
            lambda: again_log.exists() and "waiting up to" in again_log.read_text(errors="replace"),
        )
        rc = finish(run, 120)
        run.delete(GRACE)
    finally:
        run.remove()
    logs = run.logs()
    last = checkpoint_steps(run_dir)[0]
    assert rc not in (0, 1, 2, 75), logs
    assert f"status {rc} is the infrastructure's" in run.launcher.log(), logs
    assert not (run_dir / "k8s-launcher-failed").exists()
    assert not (run_dir / "result.json").exists()

    # The Job's retry: a new launcher pod and worker-0 re-created (new addresses and key pair
    # here for every pod), the same claim and command; the lock still held.
    try:
        rc, logs = run_again(cluster, tmp_path, claim, 300, run.job_uid)
    finally:
        lease.join(10)
    assert rc == 0, logs
    assert f"is locked by a run elsewhere ({holder}): waiting up to 120 s" in logs, logs
    assert lease.held is not None and lease.held < 110, lease.held  # waited out, not refused
    assert f"ckpt-{last:09d}.hvdt at epoch" in logs, logs  # the last periodic checkpoint
    r = result(run_dir)
    check_trained(r)
    assert r["weights_sha256"] == uninterrupted["result"]["weights_sha256"]


@pytest.mark.timeout(600)  # its fixtures start the pods' daemons
def test_k8s_emulated_permanent_error_is_not_run_again(cluster, tmp_path):
    """hvdtrain's exit 2 (a flag it refuses): the launcher records it on the claim, and the next
    launcher pod of the same Job with the same arguments exits 2 at once, without reaching a
    worker; a new MPIJob (a new launcher Job: a fixed image, say) with the same arguments runs."""
    job = copy.deepcopy(SMOKE)
    K.containers(job, "Launcher")[0]["args"] += ["--epochs", "-1"]
    claim = tmp_path / "claim"
    claim.mkdir()
    statuses, first_job = [], None
    for attempt in range(3):
        run = job_run(
            cluster,
            tmp_path / f"pods{attempt}",
            claim,
            job,
            job_uid=first_job if attempt == 1 else None,
        )
        first_job = first_job or run.job_uid
        try:
            run.start()
            t = time.monotonic()
            statuses.append((finish(run, 90), time.monotonic() - t))
            logs = run.logs()
            accepted = sum(
                len(re.findall(r"Accepted publickey .* from (?!::1 |127\.0\.0\.1 )", w.log()))
                for w in run.workers
            )  # not the probe's
            run.delete(GRACE)
        finally:
            run.remove()
        marker = (on_claim(claim) / "k8s-launcher-failed").read_text().splitlines()
        if attempt in (0, 2):  # run: mpirun reached the workers, the ranks refused the flag
            assert statuses[attempt][0] == 2 and accepted >= 2, logs
            assert "not run again" not in logs, logs
            assert marker[1:3] == ["2", f"job {run.job_uid}"], marker
        else:  # the Job's retry: refused at once
            assert statuses[1][0] == 2 and statuses[1][1] < 5 and accepted == 0, logs
            assert "k8s_launcher.sh: not run again: the same command ended with status 2" in logs


EVICTED = "hvdtrain-smoke-worker-1"
RECOVERY = 120  # s, from the next launcher pod's start to training resumed (its wait: 900 s)


@pytest.mark.timeout(900)  # its fixtures start the pods' daemons
def test_k8s_emulated_evicted_worker_is_replaced_and_the_job_resumes(
    cluster, uninterrupted, tmp_path
):
    """worker-1 evicted mid-run (its processes killed, the pod left Failed, its name out of
    the DNS): the launcher fails, as mpirun does when it loses a node; the operator does not
    re-create the worker (it is not missing). The Job's next launcher pod finds it Failed
    through the API server (its Role), deletes it in one line naming the pod and its reason;
    the operator re-creates it (a new pod, a new address), and the job resumes from the newest
    checkpoint within RECOVERY s, to the uninterrupted run's weights."""
    claim = tmp_path / "claim"
    claim.mkdir()
    run_dir = on_claim(claim)
    run = job_run(cluster, tmp_path / "pods", claim, JOB)
    try:
        run.start()
        wait_for_checkpoint(run, run_dir)
        first = run.pods[EVICTED]
        first_ip = cluster.hosts[EVICTED][1]
        run.evict(EVICTED)
        rc = finish(run, 120)
        failed_launcher = run.launcher.log()
        left = run.pod_json(EVICTED)
        newest = checkpoint_steps(run_dir)[0]
        t = time.monotonic()
        run.retry_launcher()
        while "resumed from" not in run.launcher.log():
            assert run.launcher.proc.poll() is None, run.logs()
            assert time.monotonic() - t < RECOVERY, f"not resumed in {RECOVERY} s\n{run.logs()}"
            time.sleep(0.2)
        recovery = time.monotonic() - t
        rc_next = finish(run, 240)
        logs = run.logs()
        api, new_ip = run.api, cluster.hosts[EVICTED][1]
        run.delete(GRACE)
    finally:
        run.remove()
    assert rc not in (0, 1, 2, 75), failed_launcher
    assert "is the infrastructure's" in failed_launcher, failed_launcher
    # Left in place, Failed, until the launcher deleted it; then a new pod of that name.
    assert (
        left["status"]
        == {
            "phase": "Failed",
            "reason": "Evicted",
            "message": (
                "The node was low on resource: ephemeral-storage. Threshold quantity: 10%, available: "
                "4%."
            ),
        }
        and left["metadata"]["uid"] == first.uid
    )
    new = run.pods[EVICTED]
    assert new is not first and new.uid != first.uid and new_ip != first_ip
    line = (
        f"k8s_launcher.sh: worker pod {EVICTED} is Failed (Evicted: The node was low on "
        "resource: ephemeral-storage. Threshold quantity: 10%, available: 4%.): deleted it, "
        "the operator re-creates it"
    )
    assert run.launcher.log().count(line) == 1, logs
    deletes = [r for r in api.requests if r[0] == "DELETE"]
    assert deletes == [("DELETE", EVICTED, "hvdtrain-launcher-smoke", 200)], api.requests
    # At most one API call for a worker every 10 s (GET, and the DELETE right after it).
    for name in {r[1] for r in api.requests}:
        gets = [t for r, t in zip(api.requests, api.times) if r[:2] == ("GET", name)]
        assert all(b - a >= 9.5 for a, b in zip(gets, gets[1:])), (name, gets)
    assert rc_next == 0, logs
    assert recovery < RECOVERY, recovery
    assert f"ckpt-{newest:09d}.hvdt at epoch" in logs, logs  # the newest checkpoint
    r = result(run_dir)
    check_trained(r)
    assert r["weights_sha256"] == uninterrupted["result"]["weights_sha256"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("without", ["token", "role"])
def test_k8s_emulated_without_the_launchers_role_a_failed_worker_is_left_with_one_line(
    cluster, tmp_path, without
):
    """A worker left Failed when a launcher pod starts (a retry's case; the test starts it at
    once), and the launcher cannot delete it: no service account token
    (automountServiceAccountToken: false), or the namespace's default account without the
    Role (the manifests before it had one: 403). One line says so and names the kubectl
    command; the wait goes on (HVDTRAIN_WAIT_WORKERS, here 14 s) and ends 255 as before; the
    worker is left in place."""
    job = copy.deepcopy(SMOKE)
    K.containers(job, "Launcher")[0].setdefault("env", []).append(
        {"name": "HVDTRAIN_WAIT_WORKERS", "value": "14"}
    )
    spec = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    if without == "token":
        spec["automountServiceAccountToken"] = False
        rbac = None
    else:
        del spec["serviceAccountName"]
        rbac = []
    claim = tmp_path / "claim"
    claim.mkdir()
    run = job_run(cluster, tmp_path / "pods", claim, job, rbac=rbac)
    try:
        run.start(before_launcher=lambda: run.evict(EVICTED))
        rc = finish(run, 90)
        log = run.launcher.log()
        run.delete(GRACE)
    finally:
        run.remove()
    host = f"{EVICTED}.hvdtrain-smoke.default.svc"
    assert rc == 255 and f"k8s_launcher.sh: error: {host} does not answer ssh" in log, log
    said = [line for line in log.splitlines() if "kubectl delete pod" in line]
    assert len(said) == 1 and said[0].endswith(f"kubectl delete pod {EVICTED} -n default"), log
    requests = run.api.requests
    if without == "token":
        assert said[0].startswith(
            f"k8s_launcher.sh: {EVICTED} does not answer ssh, and this "
            "launcher has no service account token"
        ), said
        assert requests == []
    else:
        assert said[0].startswith(
            f"k8s_launcher.sh: cannot get worker pod {EVICTED} through the API server (403: "
        ), said
        assert "lacks 'get' on pods/" in said[0], said
        # Asked again every 10 s (a Role applied meanwhile would work), said once.
        assert (
            requests
            and len(requests) <= 2
            and {r[1:] for r in requests} == {(EVICTED, "default", 403)}
        ), requests
    assert run.pod_json(EVICTED)["status"]["phase"] == "Failed"
