"""deploy/kubernetes/: hvdtrain as an MPIJob of the Kubeflow MPI Operator (kubeflow.org/v2beta1).

Offline checks (pure Python, a second in all): every kustomization renders (tests/k8s_manifests.py's
renderer, checked against ``kubectl kustomize`` where kubectl is installed); every MPIJob
validates against the operator's CRD schema (deploy/kubernetes/schema/, jsonschema, strict as
the API server's field validation) and passes the operator's own validation; the pods and Job
the operator makes of it, and the claim, validate against the Kubernetes API schemas
(kubernetes-validate, strict); the settings a restartable job needs are there; and a broken copy
of the manifests (a wrong type, a missing required field, an unknown field, a bad enum, a
restart policy the operator refuses) fails the same check.

The emulation (tests/k8s_cluster.py): the smoke overlay's MPIJob, pod by pod in network, UTS,
PID and mount namespaces: a launcher and two workers with the operator's host names, hostfile,
environment and ssh key pair, Debian's sshd in each worker (scripts/k8s_worker.sh), the
launcher running the MPIJob's exact command (scripts/k8s_launcher.sh). The job trains with
identical ranks; deleting every pod (SIGTERM to each PID 1) ends it 75 with a checkpoint on the
claim, and a new set of pods resumes from it to the uninterrupted run's weights; a job that
ends with hvdtrain's exit 2 is not run again by the next launcher pod.
"""
import copy
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

import k8s_manifests as K

pytestmark = pytest.mark.k8s

OVERLAYS = K.overlays()
RUNS = "/opt/hvdtrain/runs"  # the claim's mount path in every pod


def rendered(name):
    return K.render(OVERLAYS[name])


def containers(job, role):
    return job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"]


@pytest.mark.quick
# --- offline ------------------------------------------------------------------------------------
def test_k8s_every_kustomization_is_found():
    assert set(OVERLAYS) == {"base", "claim", "overlays/cpu", "overlays/gpu", "overlays/smoke"}


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_k8s_manifests_validate(name):
    docs = rendered(name)
    assert docs and K.check(docs) == []
    if name != "claim":
        made = K.operator_objects(K.mpijob(docs))
        assert len(made["workers"]) == K.mpijob(docs)["spec"]["mpiReplicaSpecs"]["Worker"][
            "replicas"]


@pytest.mark.quick
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_k8s_renderer_matches_kubectl_kustomize(name):
    p = subprocess.run(["kubectl", "kustomize", OVERLAYS[name]], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert [d for d in yaml.safe_load_all(p.stdout) if d] == rendered(name)


@pytest.mark.quick
@pytest.mark.parametrize("name", ["overlays/cpu", "overlays/gpu", "overlays/smoke"])
def test_k8s_what_a_restartable_job_needs(name):
    job = K.mpijob(rendered(name))
    spec = job["spec"]
    specs = spec["mpiReplicaSpecs"]
    assert (spec["mpiImplementation"], spec["sshAuthMountPath"]) == ("OpenMPI", "/root/.ssh")
    # A fresh launcher pod for every retry, a bounded number of them, workers removed at the end.
    assert specs["Launcher"]["restartPolicy"] == "Never"
    assert specs["Worker"]["restartPolicy"] == "OnFailure"
    assert 1 <= spec["runPolicy"]["backoffLimit"] <= 20
    assert spec["runPolicy"]["cleanPodPolicy"] == "Running"
    (launcher,), (worker,) = containers(job, "Launcher"), containers(job, "Worker")
    for role in ("Launcher", "Worker"):
        pod = specs[role]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 60  # the SIGTERM checkpoint's time
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert claims[mounts[RUNS]] == "hvdtrain-runs"
    (claim,) = rendered("claim")
    assert claim["metadata"]["name"] == "hvdtrain-runs"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # The launcher's TASK and flags: --run-dir on the claim, and hvdtrain's own parser takes them.
    task, *flags = launcher["args"]
    run_dir = flags[flags.index("--run-dir") + 1]
    assert run_dir.startswith(RUNS + "/")
    p = subprocess.run([sys.executable, "-m", "hvdtrain", "workers", task, *flags],
                       capture_output=True, text=True, timeout=60, cwd=K.ROOT)
    assert p.returncode == 0, p.stderr
    # The commands are this checkout's scripts at the image's path.
    for c, script in ((launcher, "k8s_launcher.sh"), (worker, "k8s_worker.sh")):
        assert c["command"] == [f"/opt/hvdtrain/scripts/{script}"]
        assert os.access(os.path.join(K.ROOT, "scripts", script), os.X_OK)
    assert worker["readinessProbe"]["tcpSocket"]["port"] == 22
    # GPUs: one slot per GPU; the CPU overlays ask for none.
    gpus = worker.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    tag = launcher["image"].rsplit(":", 1)[1]
    assert worker["image"] == launcher["image"]
    if name == "overlays/gpu":
        assert (gpus, spec["slotsPerWorker"], tag) == (4, 4, "gpu")
    else:
        assert (gpus, spec["slotsPerWorker"], tag) == (None, 1, "cpu")

@pytest.mark.quick

def test_k8s_the_image_has_what_the_pods_need():
    from k8s_cluster import Image
    image = Image()
    assert image.workdir == "/opt/hvdtrain"
    assert image.env["PATH"].startswith("/opt/hvdtrain/.venv/bin:")
    assert image.env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    assert image.from_build == [("/opt/hvdtrain", "/opt/hvdtrain")]
    copies = {dst: open(src).read() for src, dst in image.copies}
    assert re.search(r"^StrictModes no$", copies["/etc/ssh/sshd_config.d/hvdtrain.conf"], re.M)
    assert re.search(r"^UsePAM no$", copies["/etc/ssh/sshd_config.d/hvdtrain.conf"], re.M)
    client = copies["/etc/ssh/ssh_config.d/hvdtrain.conf"]
    assert "StrictHostKeyChecking no" in client and "UserKnownHostsFile /dev/null" in client
    with open(os.path.join(K.ROOT, "Dockerfile")) as f:
        dockerfile = f.read()
    runtime = dockerfile[dockerfile.rindex("\nFROM "):]
    assert "openssh-server" in runtime and "procps" in runtime  # sshd; pgrep for k8s_worker.sh


def base_job(fn):
    """A breakage of base/mpijob.yaml: ``fn(mpijob, worker pod spec)``."""
    def edit(docs):
        fn(docs, docs["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"])
    return "base/mpijob.yaml", edit


def gpu_limit(docs):
    (op,) = [op for op in docs if op["path"].endswith("containers/0/resources")]
    op["value"]["limits"]["nvidia.com/gpu"] = "four"


BREAKAGES = {
    # a wrong field type
    "slots as a string": (*base_job(lambda j, w: j["spec"].update(slotsPerWorker="4")),
                          "spec.slotsPerWorker: '4' is not of type 'integer'"),
    "grace period as a string": (
        *base_job(lambda j, w: w.update(terminationGracePeriodSeconds="120")),
        "terminationGracePeriodSeconds: '120' is not of type 'integer'"),
    "a GPU count that is no quantity": ("overlays/gpu/workers.yaml", gpu_limit,
                                        "nvidia.com/gpu: 'four' does not match"),
    # a missing required field
    "no replica specs": (*base_job(lambda j, w: j["spec"].pop("mpiReplicaSpecs")),
                         "spec: 'mpiReplicaSpecs' is a required property"),
    "a container without a name": (*base_job(lambda j, w: w["containers"][0].pop("name")),
                                   "containers.0: 'name' is a required property"),
    "a claim volume without its claim": (
        *base_job(lambda j, w: w["volumes"][0]["persistentVolumeClaim"].pop("claimName")),
        "'claimName' is a required property"),
    # an unknown field, a value outside an enum, values the operator refuses
    "a misspelt field": (*base_job(lambda j, w: j["spec"]["runPolicy"].update(backofLimit=3)),
                         "'backofLimit' was unexpected"),
    "an MPI the CRD does not know": (
        *base_job(lambda j, w: j["spec"].update(mpiImplementation="OpenMpi")),
        "'OpenMpi' is not one of ['OpenMPI', 'Intel', 'MPICH']"),
    "restart policy ExitCode": (
        *base_job(lambda j, w: j["spec"]["mpiReplicaSpecs"]["Launcher"].update(
            restartPolicy="ExitCode")),
        "restartPolicy: 'ExitCode' not supported (Never, OnFailure)"),
    "a job name too long for its pods' DNS names": (
        *base_job(lambda j, w: j["metadata"].update(name="h" * 60)), "is not a DNS-1035 label"),
}


@pytest.mark.quick
@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_k8s_a_broken_copy_fails_the_same_check(tmp_path, breakage):
    """A copy of deploy/kubernetes/ with one file broken: its kustomization, rendered, fails
    the check the real one passes."""
    tree = tmp_path / "kubernetes"
    shutil.copytree(K.DEPLOY, tree)
    name, edit, message = BREAKAGES[breakage]
    path = tree / name
    docs = yaml.safe_load(path.read_text())
    edit(docs)
    path.write_text(yaml.safe_dump(docs))
    assert K.check(K.render(os.path.join(K.DEPLOY, os.path.dirname(name)))) == []
    errors = K.check(K.render(str(path.parent)))
    assert any(message in e for e in errors), errors


@pytest.mark.quick
@pytest.mark.parametrize("field, value, message", [
    ("accessModes", "ReadWriteMany", "spec.accessModes: 'ReadWriteMany' is not of type 'array'"),
    ("resources", None,
     "spec: Additional properties are not allowed ('resourcesz' was unexpected)"),
])
def test_k8s_a_broken_claim_fails_the_same_check(tmp_path, field, value, message):
    tree = tmp_path / "kubernetes"
    shutil.copytree(K.DEPLOY, tree)
    path = tree / "claim" / "pvc.yaml"
    pvc = yaml.safe_load(path.read_text())
    if value is None:
        pvc["spec"][field + "z"] = pvc["spec"].pop(field)
    else:
        pvc["spec"][field] = value
    path.write_text(yaml.safe_dump(pvc))
    errors = K.check(K.render(str(tree / "claim")))
    assert errors and all(message in e for e in errors), errors


# --- the emulation ------------------------------------------------------------------------------
SMOKE = K.mpijob(rendered("overlays/smoke"))
RUN_DIR = containers(SMOKE, "Launcher")[0]["args"][2]  # --run-dir's value
STEPS = 1000  # the smoke task's 10 epochs of 100 steps (100 examples per step, 1,000 examples)
GRACE = 60    # the test's bound on a pod's termination (the manifest's 120 s)


@pytest.fixture(scope="module")
def cluster():
    from k8s_cluster import Network
    net = Network(f"hk{os.getpid() % 100000}")
    try:
        yield net.create()
    finally:
        net.destroy()  # and checks that no namespace or process of it is left


def on_claim(claim):
    return claim / os.path.relpath(RUN_DIR, RUNS)


def checkpoint_steps(run_dir):
    return sorted((int(re.search(r"ckpt-(\d+)\.hvdt$", p).group(1))
                   for p in glob.glob(os.path.join(run_dir, "checkpoints", "ckpt-*.hvdt"))),
                  reverse=True)


def result(run_dir):
    with open(os.path.join(run_dir, "result.json")) as f:
        return json.load(f)


def job_run(cluster, base, claim, job=SMOKE):
    from k8s_cluster import JobRun
    return JobRun(cluster, base, job, {"hvdtrain-runs": claim})


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


def check_trained(r):
    assert (r["world_size"], r["backend"], r["ranks_identical"]) == (2, "horovod", True)
    assert r["global_step"] == STEPS


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """The smoke MPIJob from start to end: what the preempted one must reproduce."""
    base = tmp_path_factory.mktemp("k8s-uninterrupted")
    claim = base / "claim"
    claim.mkdir()
    t = time.monotonic()
    run = job_run(cluster, base / "pods", claim)
    try:
        run.start()
        # PID 1 of the launcher pod is the MPIJob's command and args, exactly.
        cmd = containers(SMOKE, "Launcher")[0]
        assert launcher_argv(run)[-len(cmd["args"]) - 1:] == cmd["command"] + cmd["args"]
        rc = finish(run)
        logs = run.logs()
        statuses = run.delete(GRACE)
    finally:
        run.remove()
    return {"rc": rc, "logs": logs, "statuses": statuses, "result": result(on_claim(claim)),
            "seconds": time.monotonic() - t, "run": run}


@pytest.mark.timeout(600)  # its fixtures start the pods' daemons
def test_k8s_emulated_mpijob_trains_with_identical_ranks(uninterrupted):
    u, run = uninterrupted, uninterrupted["run"]
    assert u["rc"] == 0, u["logs"]
    check_trained(u["result"])
    # The operator's hostfile, its variables, a launch over ssh with its key pair to each worker.
    launcher = run.launcher.log()
    hosts = [f"hvdtrain-smoke-worker-{i}.hvdtrain-smoke.default.svc" for i in (0, 1)]
    assert run.objects["hostfile"] == "".join(f"{h} slots=1\n" for h in hosts)
    assert (f"k8s_launcher.sh: linear on 2 processes, 2 workers ({' '.join(hosts)}); "
            f"run dir {RUN_DIR}") in launcher, launcher
    env = {e["name"]: e.get("value") for e in run.launcher.container["env"]}
    assert env["OMPI_MCA_orte_default_hostfile"] == "/etc/mpi/hostfile"
    assert env["OMPI_MCA_plm_rsh_args"] == "-o ConnectionAttempts=10"
    for w in run.workers:
        assert "Accepted publickey for root" in w.log(), w.log()
    # Deleting the finished job's workers: each stops at once, with nothing to pass on.
    assert [u["statuses"][w.name] for w in run.workers] == [0, 0], u["logs"]


@pytest.mark.timeout(600)  # its fixtures start the pods' daemons
def test_k8s_emulated_pod_deletion_gives_75_then_new_pods_resume(cluster, uninterrupted,
                                                                  tmp_path):
    claim = tmp_path / "claim"
    claim.mkdir()
    run_dir = on_claim(claim)
    run = job_run(cluster, tmp_path / "pods", claim)
    try:
        run.start()
        deadline = time.monotonic() + 90
        while not checkpoint_steps(run_dir):
            assert run.launcher.proc.poll() is None, run.logs()
            assert time.monotonic() < deadline, f"no checkpoint in 90 s\n{run.logs()}"
            time.sleep(0.1)
        statuses = run.delete(GRACE)  # SIGTERM to every pod's PID 1, as a deletion sends it
    finally:
        run.remove()
    logs = run.logs()
    assert statuses[run.launcher.name] == 75, logs
    assert [statuses[w.name] for w in run.workers] == [0, 0], logs
    stopped = re.findall(r"stopped by SIGTERM at step (\d+); checkpoint saved", logs)
    assert stopped and len(set(stopped)) == 1, logs  # every rank at the same step
    step = int(stopped[0])
    assert 0 < step < STEPS and checkpoint_steps(run_dir)[0] == step
    assert not (run_dir / "result.json").exists()
    for w in run.workers:
        assert "passing it to this pod's ranks" in w.log(), w.log()

    # The next set of pods (new addresses, new key pair, the same claim and command).
    again = job_run(cluster, tmp_path / "pods-again", claim)
    try:
        again.start()
        rc = finish(again)
        again.delete(GRACE)
    finally:
        again.remove()
    logs = again.logs()
    assert rc == 0, logs
    assert f"ckpt-{step:09d}.hvdt at epoch" in logs, logs  # resumed from the SIGTERM's checkpoint
    r = result(run_dir)
    check_trained(r)
    assert r["weights_sha256"] == uninterrupted["result"]["weights_sha256"]


@pytest.mark.timeout(600)  # its fixtures start the pods' daemons
def test_k8s_emulated_permanent_error_is_not_run_again(cluster, tmp_path):
    """hvdtrain's exit 2 (a flag it refuses): the launcher records it on the claim, and the next
    launcher pod with the same arguments exits 2 at once, without reaching a worker."""
    job = copy.deepcopy(SMOKE)
    containers(job, "Launcher")[0]["args"] += ["--epochs", "-1"]
    claim = tmp_path / "claim"
    claim.mkdir()
    statuses = []
    for attempt in range(2):
        run = job_run(cluster, tmp_path / f"pods{attempt}", claim, job)
        try:
            run.start()
            t = time.monotonic()
            statuses.append((finish(run, 90), time.monotonic() - t))
            logs = run.logs()
            accepted = sum(w.log().count("Accepted publickey") for w in run.workers)
            run.delete(GRACE)
        finally:
            run.remove()
        if attempt == 0:
            assert statuses[0][0] == 2 and accepted >= 2, logs
            marker = (on_claim(claim) / "k8s-launcher-failed").read_text().splitlines()
            assert marker[1] == "2", marker
        else:
            assert statuses[1][0] == 2 and statuses[1][1] < 5 and accepted == 0, logs
            assert "k8s_launcher.sh: not run again: the same command ended with status 2" in logs
