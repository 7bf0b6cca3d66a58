"""deploy/kubernetes/: hvdtrain as an MPIJob of the Kubeflow MPI Operator (kubeflow.org/v2beta1).

Offline checks (pure Python, a second in all): every kustomization renders (tests/k8s_manifests.py's
renderer, checked against ``kubectl kustomize`` where kubectl is installed); every MPIJob
validates against the operator's CRD schema (deploy/kubernetes/schema/, jsonschema, strict as
the API server's field validation) and passes the operator's own validation; the pods and Job
the operator makes of it, and the claim, validate against the Kubernetes API schemas
(kubernetes-validate, strict); the settings a restartable job needs are there; and a broken copy
of the manifests (a wrong type, a missing required field, an unknown field, a bad enum, a
restart policy the operator refuses) fails the same check.

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
ends with hvdtrain's exit 2 is not run again by the next launcher pod.

Cost (two cores shared with other test runs, so noisy): the offline checks about 20 s; the
emulation 6 to 6.5 min (the uninterrupted run 77-90 s, the deletion and resume 105-165 s, the
node crash and resume 115-140 s, the permanent error 8-11 s), against 1.5 min for the two-worker
emulation before it had the three workers, the crash and the non-root pods.
"""
import copy
import fcntl
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

import pytest
import yaml

import k8s_manifests as K
from docs_pages import block

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
    assert set(OVERLAYS) == {"base", "claim", "claim-one-node", "overlays/cpu", "overlays/gpu",
                             "overlays/smoke", "overlays/smoke-one-node"}


@pytest.mark.quick
def test_k8s_the_guides_folder_tree_is_the_tree():
    """The guide's picture of deploy/kubernetes/: every folder it names exists, every folder
    with files in it is named, the kustomizations are those found, the files it names exist,
    and its workers, processes, GPUs and access modes are the manifests'."""
    tree = block("guides/clusters/kubernetes.md", "deploy/kubernetes/\n").text.splitlines()
    assert tree[0] == "deploy/kubernetes/"
    rows = [re.fullmatch(r"  (\S+)/ +(\S.*)", line).groups() for line in tree[1:]]
    named = {folder: what for folder, what in rows}
    assert len(named) == len(rows)
    folders = {os.path.relpath(d, K.DEPLOY) for d, _, files in os.walk(K.DEPLOY) if files}
    assert set(named) == folders
    assert {f for f in named if os.path.exists(os.path.join(K.DEPLOY, f, "kustomization.yaml"))
            } == set(OVERLAYS)
    for folder, what in named.items():
        for name in re.findall(r"[\w/-]+\.(?:sh|md)\b", what):
            assert (os.path.exists(os.path.join(K.DEPLOY, folder, name)) or os.path.exists(
                os.path.join(K.ROOT, "scripts", os.path.basename(name)))), name
        m = re.search(r"\b(\d+) workers(?: of (\d+) (process|GPUs))?", what)
        if m:
            spec = K.mpijob(rendered(folder))["spec"]
            assert spec["mpiReplicaSpecs"]["Worker"]["replicas"] == int(m.group(1)), folder
            if m.group(2):
                assert spec["slotsPerWorker"] == int(m.group(2)), folder
            if m.group(3) == "GPUs":
                (worker,) = containers(K.mpijob(rendered(folder)), "Worker")
                assert worker["resources"]["limits"]["nvidia.com/gpu"] == int(m.group(2))
        for mode in re.findall(r"ReadWrite\w+", what):
            assert rendered(folder)[0]["spec"]["accessModes"] == [mode], folder
    assert "2 workers" in named["base"] and "ReadWriteMany" in named["claim"]


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_k8s_manifests_validate(name):
    docs = rendered(name)
    assert docs and K.check(docs) == []
    if not name.startswith("claim"):
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


JOBS = ["overlays/cpu", "overlays/gpu", "overlays/smoke", "overlays/smoke-one-node"]


@pytest.mark.quick
@pytest.mark.parametrize("name", JOBS)
def test_k8s_what_a_restartable_job_needs(name):
    job = K.mpijob(rendered(name))
    spec = job["spec"]
    specs = spec["mpiReplicaSpecs"]
    assert (spec["mpiImplementation"], spec["sshAuthMountPath"]) == ("OpenMPI",
                                                                     "/home/mpiuser/.ssh")
    # A fresh launcher pod for every retry, enough of them for a spot fleet's reclaims, the
    # job's wall-clock time the real bound, workers removed at the end.
    assert specs["Launcher"]["restartPolicy"] == "Never"
    assert specs["Worker"]["restartPolicy"] == "OnFailure"
    assert 10 <= spec["runPolicy"]["backoffLimit"] <= 50
    assert 3600 <= spec["runPolicy"]["activeDeadlineSeconds"]
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
    # Ready once an ssh login runs a command (not an open port).
    assert worker["readinessProbe"]["exec"]["command"] == [
        "/opt/hvdtrain/scripts/k8s_worker.sh", "probe"]
    # Not root, no capability, nothing to escalate to: the "restricted" Pod Security Standard.
    for role, c in (("Launcher", launcher), ("Worker", worker)):
        pod = specs[role]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"][
            "runAsNonRoot"] is True and pod["securityContext"]["seccompProfile"] == {
            "type": "RuntimeDefault"}
        assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}}
        assert pod["imagePullSecrets"] == [{"name": "hvdtrain-pull"}]
    # Images pinned by digest; the launcher on the CPU image, in the GPU overlay too.
    images = {i["name"]: i for i in yaml.safe_load(open(os.path.join(
        OVERLAYS["overlays/gpu" if name == "overlays/gpu" else "overlays/cpu"],
        "kustomization.yaml")))["images"]}
    cpu = {i["name"]: i for i in yaml.safe_load(open(os.path.join(
        OVERLAYS["overlays/cpu"], "kustomization.yaml")))["images"]}["hvdtrain"]
    assert images["hvdtrain-launcher"] == dict(cpu, name="hvdtrain-launcher")
    for c, i in ((launcher, images["hvdtrain-launcher"]), (worker, images["hvdtrain"])):
        assert c["image"] == f"{i['newName']}@{i['digest']}"
    # GPUs: one slot per GPU; the CPU overlays ask for none.
    gpus = worker.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if name == "overlays/gpu":
        assert (gpus, spec["slotsPerWorker"]) == (4, 4)
    else:
        assert (gpus, spec["slotsPerWorker"]) == (None, 1)

@pytest.mark.quick

def test_k8s_the_image_has_what_the_pods_need(tmp_path):
    from k8s_cluster import Image
    image = Image()
    assert image.workdir == "/opt/hvdtrain"
    assert image.env["PATH"].startswith("/opt/hvdtrain/.venv/bin:")
    assert image.env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    # The GPUs a container sees are the runtime's to give (docker --gpus, the device plugin).
    assert "NVIDIA_VISIBLE_DEVICES" not in image.env
    # The build stage's venv (Horovod from its wheel): the project's files come after it.
    assert image.from_build == [("/opt/hvdtrain/.venv", "/opt/hvdtrain/.venv")]
    assert ("scripts/", "/opt/hvdtrain/scripts/") in image.project
    # mpiuser, the pods' runAsUser; no host key of the image's own.
    assert image.users == {"mpiuser": 1000} and image.host_keys_removed
    copies = {dst: open(src).read() for src, dst in image.copies}
    sshd = copies["/etc/ssh/hvdtrain/sshd_config"]
    for line in ("Port 2222", "StrictModes no", "UsePAM no", "PasswordAuthentication no"):
        assert re.search(f"^{line}$", sshd, re.M), line
    assert not re.search(r"^HostKey", sshd, re.M)  # the job's key: k8s_worker.sh gives it
    # What the Dockerfile's build checks: this sshd takes the file with a key given to it
    # (as root it also wants its privilege separation directory, which the image makes).
    if os.getuid() == 0 and not os.path.isdir("/run/sshd"):
        return
    key = tmp_path / "key"
    assert subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(key)]
                          ).returncode == 0
    p = subprocess.run(["/usr/sbin/sshd", "-t", "-f", os.path.join(
        K.DEPLOY, "ssh", "sshd_hvdtrain.conf"), "-o", f"HostKey={key}"],
        capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    client = copies["/etc/ssh/ssh_config.d/hvdtrain.conf"]
    assert "StrictHostKeyChecking no" in client and "UserKnownHostsFile /dev/null" in client
    assert re.search(r"^Host \*\.svc .*\n\s+Port 2222$", client, re.M)
    with open(os.path.join(K.ROOT, "Dockerfile")) as f:
        dockerfile = f.read()
    runtime = dockerfile[dockerfile.rindex("\nFROM "):]
    assert "openssh-server" in runtime and "procps" in runtime  # sshd; pgrep for k8s_worker.sh


@pytest.mark.quick
def test_k8s_worker_without_a_job_key_makes_a_host_key_of_its_own(tmp_path):
    """A worker started without the job's key (a container outside an MPIJob): its sshd gets
    a host key made at start, a new one per worker, and serves with it."""
    if os.getuid() != 0 or not os.path.exists("/usr/sbin/sshd") or not shutil.which("unshare"):
        pytest.skip("needs root (a network namespace per worker) and Debian's sshd")
    empty = tmp_path / "ssh"
    empty.mkdir()
    # The image's /etc/ssh: Debian's files without host keys, and hvdtrain's sshd_config.
    etc_ssh = tmp_path / "etc-ssh"
    shutil.copytree("/etc/ssh", etc_ssh, ignore=shutil.ignore_patterns("ssh_host_*"))
    (etc_ssh / "hvdtrain").mkdir(exist_ok=True)
    shutil.copy(os.path.join(K.DEPLOY, "ssh", "sshd_hvdtrain.conf"),
                etc_ssh / "hvdtrain" / "sshd_config")
    keys = []
    for _ in range(2):
        # Each worker in network, mount and PID namespaces of its own, as in a pod: sshd binds
        # port 2222 there, and the ranks k8s_worker.sh waits for at SIGTERM are the pod's
        # (none), not those of a test running beside this one.
        p = subprocess.Popen(
            ["unshare", "--net", "--mount", "--pid", "--mount-proc", "--fork", "bash", "-c",
             f'ip link set lo up && mount --bind {etc_ssh} /etc/ssh && exec "$@"', "-",
             os.path.join(K.ROOT, "scripts", "k8s_worker.sh")],
            env=dict(os.environ, HVDTRAIN_SSH_DIR=str(empty)), stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        try:
            lines, made = [], None
            reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
            reader.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (
                    made and any("Server listening" in l for l in lines)):
                time.sleep(0.1)
                m = re.search(r"sshd uses a host key made now \((\S+)\)", "".join(lines))
                made = m and m.group(1)
            assert made and any("port 2222" in l for l in lines), "".join(lines)
            keys.append(subprocess.run(["ssh-keygen", "-l", "-f", made], capture_output=True,
                                       text=True, timeout=10).stdout.split()[1])
            shutil.rmtree(os.path.dirname(made))
            os.killpg(p.pid, 15)
            assert p.wait(timeout=20) == 0
        finally:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert len(keys) == 2 and keys[0] != keys[1] and all(k.startswith("SHA256:") for k in keys)
    assert os.listdir(empty) == []


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


def filled_in(tree):
    """A copy's required edits made: storage classes, the registry, the images' digests."""
    for claim in ("claim", "claim-one-node"):
        path = tree / claim / "pvc.yaml"
        pvc = yaml.safe_load(path.read_text())
        pvc["spec"]["storageClassName"] = "efs-sc"
        path.write_text(yaml.safe_dump(pvc))
    for overlay in ("cpu", "gpu"):
        path = tree / "overlays" / overlay / "kustomization.yaml"
        k = yaml.safe_load(path.read_text())
        for i in k["images"]:
            i["newName"] = "ghcr.io/acme/hvdtrain"
            i["digest"] = "sha256:" + ("ab" if i["name"] == "hvdtrain" and overlay == "gpu"
                                       else "cd") * 32
        path.write_text(yaml.safe_dump(k))


@pytest.mark.quick
def test_k8s_the_required_edits_are_caught_one_line_each(tmp_path):
    """The shipped claim and images are placeholders the check refuses; filled in, nothing is
    left; a claim without a storage class is one line, from the command a user runs."""
    names = ("claim", "claim-one-node", "overlays/cpu", "overlays/gpu", "overlays/smoke",
             "overlays/smoke-one-node")
    left = {name: K.deploy_errors(rendered(name)) for name in names}
    assert left["claim"] == ["PersistentVolumeClaim hvdtrain-runs: spec.storageClassName is "
                             "'REPLACE-WITH-AN-RWX-CLASS': name a storage class of your cluster "
                             "that gives ReadWriteMany volumes (kubectl get sc)"]
    assert len(left["claim-one-node"]) == 1 and "ReadWriteOnce" in left["claim-one-node"][0]
    for name in names[2:]:
        assert len(left[name]) == 2 and all("is the placeholder" in e for e in left[name])
    # The guide's command as printed, from the checkout's root with its venv's python: these
    # edits, one line each, and exit 1.
    (command,) = block("guides/clusters/kubernetes.md", "python tests/k8s_manifests.py ").commands()
    words = shlex.split(command)
    assert words[:2] == ["python", "tests/k8s_manifests.py"] and len(words) > 2, words
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    p = subprocess.run(words, cwd=K.ROOT, env=env, capture_output=True, text=True, timeout=60)
    printed = [f"{d}: {e}" for d in words[2:]
               for e in left[os.path.relpath(d, "deploy/kubernetes")]]
    assert (p.returncode, p.stdout.splitlines(), p.stderr) == (1, printed, ""), p.stdout + p.stderr
    tree = tmp_path / "kubernetes"
    shutil.copytree(K.DEPLOY, tree)
    filled_in(tree)
    for name in names:
        docs = K.render(str(tree / name))
        assert K.check(docs) == [] and K.deploy_errors(docs) == [], name
    path = tree / "claim" / "pvc.yaml"
    pvc = yaml.safe_load(path.read_text())
    del pvc["spec"]["storageClassName"]  # the cluster's default class would decide
    path.write_text(yaml.safe_dump(pvc))
    p = subprocess.run([sys.executable, os.path.join(K.ROOT, "tests", "k8s_manifests.py"),
                        str(tree / "claim"), str(tree / "overlays" / "gpu")],
                       capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout.splitlines()) == (1, [
        f"{tree / 'claim'}: PersistentVolumeClaim hvdtrain-runs: spec.storageClassName is "
        "missing: name a storage class of your cluster that gives ReadWriteMany volumes "
        "(kubectl get sc)"]), p.stdout + p.stderr


@pytest.mark.quick
def test_k8s_one_node_smoke_keeps_every_pod_with_the_first():
    job = K.mpijob(rendered("overlays/smoke-one-node"))
    (claim,) = rendered("claim-one-node")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    made = K.operator_objects(job)
    pods = [made["launcher"]["spec"]["template"]] + made["workers"]
    for pod in pods:
        (term,) = pod["spec"]["affinity"]["podAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        # The label the operator puts on every pod of this job, this one included (what
        # lets the scheduler place the first one anywhere).
        for k, v in term["labelSelector"]["matchLabels"].items():
            assert pod["metadata"]["labels"][k] == v
    assert job["metadata"]["name"] == "hvdtrain-smoke"


def documented_status_command():
    """The MPIJob status command of the Kubernetes guide: its -o jsonpath= argument."""
    (cmd,) = block("guides/clusters/kubernetes.md",
                   "kubectl get mpijob hvdtrain-smoke -o jsonpath=").commands()
    words = shlex.split(cmd)
    assert words[:4] == ["kubectl", "get", "mpijob", SMOKE["metadata"]["name"]], words
    assert words[4:6] == ["-o", words[5]] and words[5].startswith("jsonpath="), words
    return words[5][len("jsonpath="):]


# kubectl's names of the kinds the guide's commands use (`kubectl api-resources` on a cluster).
KINDS = {"sc": "StorageClass", "pvc": "PersistentVolumeClaim", "crd": "CustomResourceDefinition",
         "pods": "Pod", "mpijob": "MPIJob", "job": "Job"}


def kubectl_flags(verb):
    """{flag: takes a value} of `kubectl VERB --help`."""
    p = subprocess.run(["kubectl", verb, "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    flags = {}
    for short, name, default in re.findall(r"^\s+(?:-(\w), )?--([\w-]+)=(\S*):$", p.stdout, re.M):
        value = default not in ("true", "false")
        flags[f"--{name}"] = value
        if short:
            flags[f"-{short}"] = value
    assert len(flags) > 5, p.stdout
    return flags


def kubectl_command(words, flags):
    """(verb, {flag: value}, positional arguments) of a kubectl command line, each flag one
    that `kubectl VERB --help` lists (flags None: not checked, kubectl missing)."""
    assert words[0] == "kubectl", words
    verb, given, args, i = words[1], {}, [], 2
    while i < len(words):
        word = words[i]
        if word.startswith("-"):
            name, eq, value = word.partition("=")
            if flags is not None:
                assert name in flags, (words, name)
            if not eq and (flags or {}).get(name, name in ("-f", "-k", "-l", "-o")):
                i, value = i + 1, words[i + 1]
            given[name] = value
        else:
            args.append(word)
        i += 1
    return verb, given, args


@pytest.mark.quick
def test_k8s_the_guides_kubectl_commands_name_what_the_manifests_make():
    """Every kubectl command of the guide's install, claim, run and recovery blocks: each flag
    one that kubectl has (where kubectl is installed); each kustomization it applies or deletes
    one of deploy/kubernetes/; the operator's manifest that of the release the CRD schema was
    taken from (schema/PROVENANCE.md); and each object it names (the CRD, the claim, an
    MPIJob, its launcher Job, its pods' label) what those manifests and the operator make."""
    have_kubectl = shutil.which("kubectl") is not None
    flags = {}
    provenance = open(os.path.join(K.DEPLOY, "schema", "PROVENANCE.md")).read()
    release = re.search(r'\("Prepare (v[\d.]+)"', provenance).group(1)
    operator_file = re.search(r"`(deploy/v2beta1/[\w-]+\.yaml)`", provenance).group(1)
    (claim,) = rendered("claim")
    group = SMOKE["apiVersion"].split("/")[0]
    blocks = [block("guides/clusters/kubernetes.md", "kubectl apply --server-side -f "),
              block("guides/clusters/kubernetes.md", "kubectl get sc "),
              block("guides/clusters/kubernetes.md",
                    "kubectl apply -k deploy/kubernetes/overlays/smoke "),
              block("guides/clusters/kubernetes.md", "kubectl delete mpijob hvdtrain ")]
    seen = set()
    for b in blocks:
        commands = [shlex.split(c) for c in b.commands()]
        # The MPIJobs of the kustomizations the block applies: those applied so far, for the
        # commands that read a running job; any of the block's for `kubectl delete mpijob`,
        # which deletes a job applied before so that the block can apply it again.
        jobs, block_jobs = {}, {}
        for words in commands:
            if "-k" in words:
                path = os.path.relpath(os.path.join(K.ROOT, words[words.index("-k") + 1]), K.DEPLOY)
                assert path in OVERLAYS, words
                block_jobs.update({d["metadata"]["name"]: d for d in rendered(path)
                                   if d["kind"] == "MPIJob"})
        for words in commands:
            if have_kubectl and words[1] not in flags:
                flags[words[1]] = kubectl_flags(words[1])
            verb, given, args = kubectl_command(words, flags.get(words[1]))
            seen.add(verb)
            if verb in ("apply", "delete") and "-k" in given:
                assert args == [], words
                made = {d["metadata"]["name"]: d for d in rendered(os.path.relpath(
                    os.path.join(K.ROOT, given["-k"]), K.DEPLOY)) if d["kind"] == "MPIJob"}
                if verb == "apply":
                    jobs.update(made)
                else:
                    assert made and all(jobs.pop(name, None) for name in made), words
            elif verb == "apply":
                assert args == [] and given == {"--server-side": "", "-f": (
                    f"https://raw.githubusercontent.com/kubeflow/mpi-operator/{release}/"
                    f"{operator_file}")}, words
            elif verb == "logs":
                kind, name = args[0].split("/")
                assert KINDS[kind] == "Job" and name in [
                    K.operator_objects(j)["launcher"]["metadata"]["name"] for j in jobs.values()]
            elif args[:1] == ["pods"]:
                key, value = given["-l"].split("=")  # every pod of one of those jobs
                selected = []
                for made in map(K.operator_objects, jobs.values()):
                    pods = [p["metadata"]["labels"] for p in made["workers"]] + [
                        made["launcher"]["spec"]["template"]["metadata"]["labels"]]
                    if all(labels.get(key) == value for labels in pods):
                        selected.append(made)
                assert len(selected) == 1, words
            else:
                kind, names = KINDS[args[0]], args[1:]
                want = {"StorageClass": [], "CustomResourceDefinition": [f"mpijobs.{group}"],
                        "PersistentVolumeClaim": [claim["metadata"]["name"]],
                        "MPIJob": [n for n in names[:1]
                                   if n in (block_jobs if verb == "delete" else jobs)]}
                assert names == want[kind], (words, list(jobs))
    assert seen == {"apply", "get", "describe", "logs", "delete"}
    # The claim's required edit names the same command for the classes.
    assert "(kubectl get sc)" in K.deploy_errors(rendered("claim"))[0]


@pytest.mark.quick
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_k8s_the_documented_status_command_shows_the_conditions(tmp_path):
    """Against an MPIJob's status as the operator writes it (pkg/controller/mpi_job_status.go:
    a Failed job after an eviction: Running set False, no completionTime), offline: kubectl
    label --local evaluates the same -o jsonpath."""
    job = copy.deepcopy(SMOKE)
    job["status"] = {"conditions": [
        {"type": "Created", "status": "True", "reason": "MPIJobCreated",
         "message": "MPIJob default/hvdtrain-smoke is created."},
        {"type": "Running", "status": "False", "reason": "MPIJobRunning",
         "message": "MPIJob default/hvdtrain-smoke is running."},
        {"type": "Failed", "status": "True", "reason": "MPIJobEvicted",
         "message": "launcher pod was evicted"}],
        "startTime": "2026-01-01T00:00:00Z"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    p = subprocess.run(["kubectl", "label", "--local", "-f", str(path), "x=y", "-o",
                        f"jsonpath={documented_status_command()}"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "Created=True MPIJobCreated: MPIJob default/hvdtrain-smoke is created.",
        "Running=False MPIJobRunning: MPIJob default/hvdtrain-smoke is running.",
        "Failed=True MPIJobEvicted: launcher pod was evicted",
        "completionTime: "], p.stdout


# --- the emulation ------------------------------------------------------------------------------
# What the guide's first command of a run applies (`kubectl apply -k .../overlays/smoke`): the
# MPIJob the emulation runs.
SMOKE_APPLY = shlex.split(block("guides/clusters/kubernetes.md",
                                "kubectl apply -k deploy/kubernetes/overlays/smoke ").commands()[0])
SMOKE = K.mpijob(K.render(os.path.join(K.ROOT, SMOKE_APPLY[SMOKE_APPLY.index("-k") + 1])))
RUN_DIR = containers(SMOKE, "Launcher")[0]["args"][2]  # --run-dir's value
GRACE = 60    # the test's bound on a pod's termination (the manifest's 120 s)


def three_workers(job, epochs=4):
    """The smoke job on 3 workers, each daemon started by the one before (Open MPI's tree
    spawn with radix 1: the worker-to-worker ssh that jobs of more than 64 workers do), for
    ``epochs`` epochs instead of 10 (two cores run the three ranks)."""
    job = copy.deepcopy(job)
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = 3
    args = containers(job, "Launcher")[0]["args"]
    args[args.index("--epochs") + 1] = str(epochs)
    containers(job, "Launcher")[0].setdefault("env", []).append(
        {"name": "OMPI_MCA_routed_radix", "value": "1"})
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


def run_again(cluster, tmp_path, claim, timeout):
    """The next set of pods in tmp_path/pods-again (the same claim and command), run to the
    launcher's end and deleted: (its status, the pods' logs)."""
    again = job_run(cluster, tmp_path / "pods-again", claim, JOB)
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
    return (fields["Uid"].split()[0], int(fields["CapEff"], 16), int(fields["CapBnd"], 16),
            fields["NoNewPrivs"])


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """The smoke MPIJob from start to end: what the preempted one must reproduce."""
    base = tmp_path_factory.mktemp("k8s-uninterrupted")
    claim = base / "claim"
    claim.mkdir()
    t = time.monotonic()
    run = job_run(cluster, base / "pods", claim, JOB)
    try:
        run.start()
        # PID 1 of the launcher pod is the MPIJob's command and args, exactly.
        cmd = containers(JOB, "Launcher")[0]
        assert launcher_argv(run)[-len(cmd["args"]) - 1:] == cmd["command"] + cmd["args"]
        creds = {p.name: credentials(p.pid1()) for p in run.pods.values()}
        addresses = {name: cluster.hosts[name][1] for name in run.pods}
        rc = finish(run, 240)
        logs = run.logs()
        statuses = run.delete(GRACE)
    finally:
        run.remove()
    return {"rc": rc, "logs": logs, "statuses": statuses, "result": result(on_claim(claim)),
            "seconds": time.monotonic() - t, "run": run, "creds": creds, "addresses": addresses,
            "owner": os.stat(on_claim(claim) / "result.json").st_uid}


@pytest.mark.timeout(600)  # its fixtures start the pods' daemons
def test_k8s_emulated_mpijob_trains_with_identical_ranks(uninterrupted):
    u, run = uninterrupted, uninterrupted["run"]
    assert u["rc"] == 0, u["logs"]
    check_trained(u["result"])
    # The operator's hostfile, its variables, a launch over ssh with its key pair to each worker.
    launcher = run.launcher.log()
    hosts = [f"hvdtrain-smoke-worker-{i}.hvdtrain-smoke.default.svc" for i in range(WORKERS)]
    assert run.objects["hostfile"] == "".join(f"{h} slots=1\n" for h in hosts)
    assert (f"k8s_launcher.sh: linear on 3 processes, 3 workers ({' '.join(hosts)}); "
            f"run dir {RUN_DIR}") in launcher, launcher
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
    # Deleting the finished job's workers: each stops at once, with nothing to pass on.
    assert [u["statuses"][w.name] for w in run.workers] == [0] * WORKERS, u["logs"]


@pytest.mark.timeout(600)  # its fixtures start the pods' daemons
def test_k8s_emulated_pod_deletion_gives_75_then_new_pods_resume(cluster, uninterrupted,
                                                                  tmp_path):
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
    rc, logs = run_again(cluster, tmp_path, claim, 240)
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
        lease = Lease(run_dir / ".lock", lambda: again_log.exists() and
                      "waiting up to" in again_log.read_text(errors="replace"))
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
        rc, logs = run_again(cluster, tmp_path, claim, 300)
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
            accepted = sum(len(re.findall(r"Accepted publickey .* from (?!::1 |127\.0\.0\.1 )",
                                          w.log())) for w in run.workers)  # not the probe's
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
