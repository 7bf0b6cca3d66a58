"""deploy/kubernetes/ offline: hvdtrain as an MPIJob of the Kubeflow MPI Operator
(kubeflow.org/v2beta1), checked without a cluster (pure Python, about 20 s).

Every kustomization renders (tests/k8s_manifests.py's renderer, checked against ``kubectl
kustomize`` where kubectl is installed); every MPIJob validates against the operator's CRD
schema (deploy/kubernetes/schema/, jsonschema, strict as the API server's field validation) and
passes the operator's own validation; the pods and Job the operator makes of it, and the claim,
validate against the Kubernetes API schemas (kubernetes-validate, strict); the settings a
restartable job needs are there; and a broken copy of the manifests (a wrong type, a missing
required field, an unknown field, a bad enum, a restart policy the operator refuses) fails the
same check. The pod-by-pod emulation is tests/clusters/test_k8s.py; the Kubernetes guide's
commands against these manifests, tests/clusters/test_k8s_guide.py.
"""

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


@pytest.mark.quick
# --- offline ------------------------------------------------------------------------------------
def test_k8s_every_kustomization_is_found():
    assert set(OVERLAYS) == {
        "base",
        "claim",
        "claim-one-node",
        "overlays/cpu",
        "overlays/gpu",
        "overlays/smoke",
        "overlays/smoke-one-node",
    }


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_k8s_manifests_validate(name):
    docs = K.rendered(name)
    assert docs and K.check(docs) == []
    if not name.startswith("claim"):
        made = K.operator_objects(K.mpijob(docs))
        assert (
            len(made["workers"]) == K.mpijob(docs)["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
        )


@pytest.mark.quick
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_k8s_renderer_matches_kubectl_kustomize(name):
    p = subprocess.run(
        ["kubectl", "kustomize", OVERLAYS[name]], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert [d for d in yaml.safe_load_all(p.stdout) if d] == K.rendered(name)


JOBS = ["overlays/cpu", "overlays/gpu", "overlays/smoke", "overlays/smoke-one-node"]


@pytest.mark.quick
@pytest.mark.parametrize("name", JOBS)
def test_k8s_what_a_restartable_job_needs(name):
    job = K.mpijob(K.rendered(name))
    spec = job["spec"]
    specs = spec["mpiReplicaSpecs"]
    assert (spec["mpiImplementation"], spec["sshAuthMountPath"]) == (
        "OpenMPI",
        "/home/mpiuser/.ssh",
    )
    # A fresh launcher pod for every retry, enough of them for a spot fleet's reclaims, the
    # job's wall-clock time the real bound, workers removed at the end.
    assert specs["Launcher"]["restartPolicy"] == "Never"
    assert specs["Worker"]["restartPolicy"] == "OnFailure"
    if "smoke" in name:  # a check: a failure shows within the half hour
        assert (spec["runPolicy"]["backoffLimit"], spec["runPolicy"]["activeDeadlineSeconds"]) == (
            2,
            1800,
        )
    else:
        assert 10 <= spec["runPolicy"]["backoffLimit"] <= 50
        assert 3600 <= spec["runPolicy"]["activeDeadlineSeconds"]
    assert spec["runPolicy"]["cleanPodPolicy"] == "Running"
    (launcher,), (worker,) = K.containers(job, "Launcher"), K.containers(job, "Worker")
    for role in ("Launcher", "Worker"):
        pod = specs[role]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 60  # the SIGTERM checkpoint's time
        # The claim re-owned only when it is not yet; no Istio sidecar between the ranks.
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
        assert specs[role]["template"]["metadata"]["annotations"] == {
            "sidecar.istio.io/inject": "false"
        }
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert claims[mounts[K.RUNS]] == "hvdtrain-runs"
    (claim,) = K.rendered("claim")
    assert claim["metadata"]["name"] == "hvdtrain-runs"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # The launcher Job's UID, which keys a user's mistake recorded on the claim to that Job.
    assert {
        "name": "HVDTRAIN_LAUNCHER_JOB",
        "valueFrom": {
            "fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}
        },
    } in launcher["env"]
    # The launcher's TASK and flags: --run-dir on the claim, and hvdtrain's own parser takes them.
    task, *flags = launcher["args"]
    run_dir = flags[flags.index("--run-dir") + 1]
    assert run_dir.startswith(K.RUNS + "/")
    p = subprocess.run(
        [sys.executable, "-m", "hvdtrain", "workers", task, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=K.ROOT,
    )
    assert p.returncode == 0, p.stderr
    # The commands are this checkout's scripts at the image's path.
    for c, script in ((launcher, "k8s_launcher.sh"), (worker, "k8s_worker.sh")):
        assert c["command"] == [f"/opt/hvdtrain/scripts/{script}"]
        assert os.access(os.path.join(K.ROOT, "scripts", script), os.X_OK)
        # glibc's huge-page tunable: launch_cluster.sh's to set for the ranks, not a pod's
        assert "GLIBC_TUNABLES" not in {e["name"] for e in c.get("env", [])}
    # Ready once an ssh login runs a command (not an open port).
    assert worker["readinessProbe"]["exec"]["command"] == [
        "/opt/hvdtrain/scripts/k8s_worker.sh",
        "probe",
    ]
    # Not root, no capability, nothing to escalate to: the "restricted" Pod Security Standard.
    for role, c in (("Launcher", launcher), ("Worker", worker)):
        pod = specs[role]["template"]["spec"]
        assert (
            pod["securityContext"]["runAsUser"] == 1000
            and pod["securityContext"]["runAsNonRoot"] is True
            and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        )
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
        assert pod["imagePullSecrets"] == [{"name": "hvdtrain-pull"}]
    # Images pinned by digest; the launcher on the CPU image, in the GPU overlay too.
    images = {
        i["name"]: i
        for i in yaml.safe_load(
            open(
                os.path.join(
                    OVERLAYS["overlays/gpu" if name == "overlays/gpu" else "overlays/cpu"],
                    "kustomization.yaml",
                )
            )
        )["images"]
    }
    cpu = {
        i["name"]: i
        for i in yaml.safe_load(open(os.path.join(OVERLAYS["overlays/cpu"], "kustomization.yaml")))[
            "images"
        ]
    }["hvdtrain"]
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
    # Huge pages are the launchers' and the ranks' to decide on each node (THP there, the off
    # switch): an image value would be taken for the user's own and never changed.
    assert not {"GLIBC_TUNABLES", "HVDTRAIN_HUGETLB"} & set(image.env)
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
    assert (
        subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-N", "", "-f", str(key)]).returncode
        == 0
    )
    p = subprocess.run(
        [
            "/usr/sbin/sshd",
            "-t",
            "-f",
            os.path.join(K.DEPLOY, "ssh", "sshd_hvdtrain.conf"),
            "-o",
            f"HostKey={key}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    client = copies["/etc/ssh/ssh_config.d/hvdtrain.conf"]
    assert "StrictHostKeyChecking no" in client and "UserKnownHostsFile /dev/null" in client
    # Port 2222 for every name: the operator's hostfile names pods under the cluster's own
    # domain (cluster.local, or another), and the probe logs in to localhost.
    for host in (
        "hvdtrain-worker-0.hvdtrain.default.svc",
        "hvdtrain-worker-0.hvdtrain.default.svc.cluster.local",
        "w-1.hvdtrain.team.svc.corp.example",
        "localhost",
    ):
        p = subprocess.run(
            ["ssh", "-G", "-F", os.path.join(K.DEPLOY, "ssh", "ssh_hvdtrain.conf"), host],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert p.returncode == 0 and re.search(r"^port 2222$", p.stdout, re.M), (host, p.stderr)
    with open(os.path.join(K.ROOT, "Dockerfile")) as f:
        dockerfile = f.read()
    runtime = dockerfile[dockerfile.rindex("\nFROM ") :]
    assert "openssh-server" in runtime and "procps" in runtime  # sshd; pgrep for k8s_worker.sh


@pytest.mark.quick
@pytest.mark.parametrize("where", ["claim/run", "claim"])
def test_k8s_launcher_says_in_one_line_that_it_cannot_write_the_run_directory(tmp_path, where):
    """A claim the pods' user cannot write (a root-squashed NFS export, root's directory): the
    launcher's one line and status 2 before anything else, not mpirun's failures retried."""
    from conftest import NO_DAC

    claim = tmp_path / "claim"
    claim.mkdir()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("hvdtrain-worker-0.hvdtrain.default.svc slots=1\n")
    claim.chmod(0o555)  # no one writes it, root without CAP_DAC_OVERRIDE included
    try:
        p = subprocess.run(
            [
                *NO_DAC,
                "bash",
                os.path.join(K.ROOT, "scripts", "k8s_launcher.sh"),
                "linear",
                "--run-dir",
                str(tmp_path / where),
                "--epochs",
                "1",
            ],
            # The launcher asks hvdtrain for the run directory with PYTHON, the image's venv by
            # default; CI exports PYTHON for scripts/setup.sh (Debian's Python, no numpy).
            env=dict(
                os.environ, OMPI_MCA_orte_default_hostfile=str(hostfile), PYTHON=sys.executable
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        claim.chmod(0o755)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(
        f"k8s_launcher.sh: error: uid {os.getuid()} cannot write the run directory "
        f"{tmp_path / where} (Permission denied): the claim's files"
    ), p.stderr
    assert os.listdir(claim) == []


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
    shutil.copy(
        os.path.join(K.DEPLOY, "ssh", "sshd_hvdtrain.conf"), etc_ssh / "hvdtrain" / "sshd_config"
    )
    keys = []
    for _ in range(2):
        # Each worker in network, mount and PID namespaces of its own, as in a pod: sshd binds
        # port 2222 there, and the ranks k8s_worker.sh waits for at SIGTERM are the pod's
        # (none), not those of a test running beside this one.
        p = subprocess.Popen(
            [
                "unshare",
                "--net",
                "--mount",
                "--pid",
                "--mount-proc",
                "--fork",
                "bash",
                "-c",
                f'ip link set lo up && mount --bind {etc_ssh} /etc/ssh && exec "$@"',
                "-",
                os.path.join(K.ROOT, "scripts", "k8s_worker.sh"),
            ],
            env=dict(os.environ, HVDTRAIN_SSH_DIR=str(empty), TMPDIR=str(tmp_path)),
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            lines, made = [], None
            reader = threading.Thread(target=lambda: lines.extend(p.stderr), daemon=True)
            reader.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (
                made and any("Server listening" in l for l in lines)
            ):
                time.sleep(0.1)
                m = re.search(r"sshd uses a host key made now \((\S+)\)", "".join(lines))
                made = m and m.group(1)
            assert made and any("port 2222" in l for l in lines), "".join(lines)
            keys.append(
                subprocess.run(
                    ["ssh-keygen", "-l", "-f", made], capture_output=True, text=True, timeout=10
                ).stdout.split()[1]
            )
            shutil.rmtree(os.path.dirname(made))
            os.killpg(p.pid, 15)
            assert p.wait(timeout=20) == 0
        finally:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert len(keys) == 2 and keys[0] != keys[1] and all(k.startswith("SHA256:") for k in keys)
    assert os.listdir(empty) == []


@pytest.mark.quick
@pytest.mark.parametrize("name", JOBS)
def test_k8s_the_launcher_may_get_and_delete_only_its_own_workers(name):
    """The launcher's ServiceAccount, Role and RoleBinding, rendered with the MPIJob: the
    launcher pod runs as that account, bound to that Role alone, whose one rule is get and
    delete on pods named exactly as the pods the operator makes for this MPIJob's workers."""
    docs = K.rendered(name)
    job = K.mpijob(docs)
    kinds = {d["kind"]: d for d in docs if d["kind"] != "MPIJob"}
    assert sorted(kinds) == ["Role", "RoleBinding", "ServiceAccount"]
    made = K.operator_objects(job)
    launcher = made["launcher"]["spec"]["template"]["spec"]
    assert launcher["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]
    assert "serviceAccountName" not in made["workers"][0]["spec"]  # the workers: no API use
    binding = kinds["RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": kinds["Role"]["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": launcher["serviceAccountName"]}
    ]
    assert kinds["Role"]["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["pods"],
            "verbs": ["get", "delete"],
            "resourceNames": [w["metadata"]["name"] for w in made["workers"]],
        }
    ]
    assert K.rbac_errors(docs) == []


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
    "slots as a string": (
        *base_job(lambda j, w: j["spec"].update(slotsPerWorker="4")),
        "spec.slotsPerWorker: '4' is not of type 'integer'",
    ),
    "grace period as a string": (
        *base_job(lambda j, w: w.update(terminationGracePeriodSeconds="120")),
        "terminationGracePeriodSeconds: '120' is not of type 'integer'",
    ),
    "a GPU count that is no quantity": (
        "overlays/gpu/workers.yaml",
        gpu_limit,
        "nvidia.com/gpu: 'four' does not match",
    ),
    # a missing required field
    "no replica specs": (
        *base_job(lambda j, w: j["spec"].pop("mpiReplicaSpecs")),
        "spec: 'mpiReplicaSpecs' is a required property",
    ),
    "a container without a name": (
        *base_job(lambda j, w: w["containers"][0].pop("name")),
        "containers.0: 'name' is a required property",
    ),
    "a claim volume without its claim": (
        *base_job(lambda j, w: w["volumes"][0]["persistentVolumeClaim"].pop("claimName")),
        "'claimName' is a required property",
    ),
    # an unknown field, a value outside an enum, values the operator refuses
    "a misspelt field": (
        *base_job(lambda j, w: j["spec"]["runPolicy"].update(backofLimit=3)),
        "'backofLimit' was unexpected",
    ),
    "an MPI the CRD does not know": (
        *base_job(lambda j, w: j["spec"].update(mpiImplementation="OpenMpi")),
        "'OpenMpi' is not one of ['OpenMPI', 'Intel', 'MPICH']",
    ),
    "restart policy ExitCode": (
        *base_job(
            lambda j, w: j["spec"]["mpiReplicaSpecs"]["Launcher"].update(restartPolicy="ExitCode")
        ),
        "restartPolicy: 'ExitCode' not supported (Never, OnFailure)",
    ),
    "a third worker the launcher's Role does not name": (
        *base_job(lambda j, w: j["spec"]["mpiReplicaSpecs"]["Worker"].update(replicas=3)),
        "not get and delete on this MPIJob's worker pods ['hvdtrain-worker-0', "
        "'hvdtrain-worker-1', 'hvdtrain-worker-2']",
    ),
    "a job name too long for its pods' DNS names": (
        *base_job(lambda j, w: j["metadata"].update(name="h" * 60)),
        "is not a DNS-1035 label",
    ),
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
@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "accessModes",
            "ReadWriteMany",
            "spec.accessModes: 'ReadWriteMany' is not of type 'array'",
        ),
        (
            "resources",
            None,
            "spec: Additional properties are not allowed ('resourcesz' was unexpected)",
        ),
    ],
)
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
            i["digest"] = (
                "sha256:" + ("ab" if i["name"] == "hvdtrain" and overlay == "gpu" else "cd") * 32
            )
        path.write_text(yaml.safe_dump(k))


@pytest.mark.quick
def test_k8s_the_required_edits_are_caught_one_line_each(tmp_path):
    """The shipped claim and images are placeholders the check refuses; filled in, nothing is
    left; a claim without a storage class is one line, from the command a user runs."""
    names = (
        "claim",
        "claim-one-node",
        "overlays/cpu",
        "overlays/gpu",
        "overlays/smoke",
        "overlays/smoke-one-node",
    )
    left = {name: K.deploy_errors(K.rendered(name)) for name in names}
    assert left["claim"] == [
        "PersistentVolumeClaim hvdtrain-runs: spec.storageClassName is "
        "'REPLACE-WITH-AN-RWX-CLASS': name a storage class of your cluster "
        "that gives ReadWriteMany volumes (kubectl get sc)"
    ]
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
    printed = [
        f"{d}: {e}" for d in words[2:] for e in left[os.path.relpath(d, "deploy/kubernetes")]
    ]
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
    p = subprocess.run(
        [
            sys.executable,
            os.path.join(K.ROOT, "tests", "k8s_manifests.py"),
            str(tree / "claim"),
            str(tree / "overlays" / "gpu"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (p.returncode, p.stdout.splitlines()) == (
        1,
        [
            f"{tree / 'claim'}: PersistentVolumeClaim hvdtrain-runs: spec.storageClassName is "
            "missing: name a storage class of your cluster that gives ReadWriteMany volumes "
            "(kubectl get sc)"
        ],
    ), p.stdout + p.stderr


@pytest.mark.quick
def test_k8s_one_node_smoke_keeps_every_pod_with_the_first():
    job = K.mpijob(K.rendered("overlays/smoke-one-node"))
    (claim,) = K.rendered("claim-one-node")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    made = K.operator_objects(job)
    pods = [made["launcher"]["spec"]["template"]] + made["workers"]
    for pod in pods:
        (term,) = pod["spec"]["affinity"]["podAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        # The label the operator puts on every pod of this job, this one included (what
        # lets the scheduler place the first one anywhere).
        for k, v in term["labelSelector"]["matchLabels"].items():
            assert pod["metadata"]["labels"][k] == v
    assert job["metadata"]["name"] == "hvdtrain-smoke"


class Pods:
    """What the emulated API server (k8s_cluster.ApiServer) asks of a cluster: pods by name."""

    def __init__(self, pods):
        self.pods, self.deleted = pods, []

    def pod_json(self, name):
        return self.pods.get(name)

    def delete_pod(self, name, uid=None):
        pod = self.pods.get(name)
        if pod is None:
            return 404, None
        if uid != pod["metadata"]["uid"]:
            return 409, None
        self.deleted.append((name, uid))
        return 200, self.pods.pop(name)


def pod(name, phase, reason=None, message=None):
    status = {"phase": phase, **({"reason": reason, "message": message} if reason else {})}
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "status": status,
    }


@pytest.mark.quick
def test_k8s_the_launchers_api_client_deletes_only_a_failed_worker(tmp_path):
    """scripts/k8s_pods.py (the launcher's part in replacing a Failed worker) against the
    emulation's API server with the smoke overlay's Role: a Failed worker deleted (its UID
    the precondition) and named in one line with its reason; a running one, or one already
    gone, left alone and not mentioned; a pod outside the Role's names, a service account
    without the Role, no token at all, an API server that does not answer: one line each,
    naming what is missing and the kubectl command that deletes the pod."""
    from k8s_cluster import ApiServer

    docs = K.rendered("overlays/smoke")
    rbac = [d for d in docs if d["kind"] != "MPIJob"]
    evicted = "The node was low on resource: ephemeral-storage."
    pods = Pods(
        {
            "hvdtrain-smoke-worker-0": pod("hvdtrain-smoke-worker-0", "Running"),
            "hvdtrain-smoke-worker-1": pod("hvdtrain-smoke-worker-1", "Failed", "Evicted", evicted),
            "hvdtrain-worker-1": pod("hvdtrain-worker-1", "Failed", "Evicted", evicted),
        }
    )
    api = ApiServer("default", rbac, pods).start()
    try:

        def replace(host, account="hvdtrain-launcher-smoke", url=api.url):
            sa = tmp_path / f"sa-{account}"
            sa.mkdir(exist_ok=True)
            if account:
                (sa / "token").write_text(api.token(account))
                (sa / "namespace").write_text("default")
            p = subprocess.run(
                [
                    sys.executable,
                    os.path.join(K.ROOT, "scripts", "k8s_pods.py"),
                    "replace-failed",
                    f"{host}.hvdtrain-smoke.default.svc",
                ],
                env=dict(os.environ, HVDTRAIN_K8S_API=url, HVDTRAIN_K8S_SA_DIR=str(sa)),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert p.stderr == "" and p.stdout.count("\n") == (1 if p.stdout else 0), p.stdout
            return p.returncode, p.stdout.strip()

        assert replace("hvdtrain-smoke-worker-0") == (0, "")
        assert api.requests == [("GET", "hvdtrain-smoke-worker-0", "hvdtrain-launcher-smoke", 200)]
        assert replace("hvdtrain-smoke-worker-1") == (
            10,
            (
                f"worker pod hvdtrain-smoke-worker-1 is Failed (Evicted: {evicted}): deleted it, "
                "the operator re-creates it"
            ),
        )
        assert pods.deleted == [("hvdtrain-smoke-worker-1", "uid-hvdtrain-smoke-worker-1")]
        assert replace("hvdtrain-smoke-worker-1") == (0, "")  # gone: being re-created
        # Another job's pod of the same namespace: outside the Role's names.
        rc, line = replace("hvdtrain-worker-1")
        assert rc == 5 and line.startswith(
            "cannot get worker pod hvdtrain-worker-1 through the API server (403: pods "
            '"hvdtrain-worker-1" is forbidden: User "system:serviceaccount:default:'
            'hvdtrain-launcher-smoke" cannot get resource "pods"'
        ), line
        assert line.endswith(
            "lacks 'get' on pods/hvdtrain-worker-1 (its Role, "
            "deploy/kubernetes/base, is not applied or not bound); a Failed "
            "worker is left to you: kubectl delete pod hvdtrain-worker-1 -n "
            "default"
        ), line
        assert "hvdtrain-worker-1" in pods.pods
        # The namespace's default account (the manifests without the launcher's Role).
        rc, line = replace("hvdtrain-smoke-worker-0", account="default")
        assert (
            rc == 5
            and "system:serviceaccount:default:default" in line
            and line.endswith("kubectl delete pod hvdtrain-smoke-worker-0 -n default")
        ), line
        # No token (automountServiceAccountToken: false): said, nothing asked.
        n = len(api.requests)
        rc, line = replace("hvdtrain-smoke-worker-0", account="")
        assert (
            rc == 3
            and "this launcher has no service account token" in line
            and line.endswith("delete it: kubectl delete pod hvdtrain-smoke-worker-0 -n default")
        ), line
        assert len(api.requests) == n
        rc, line = replace("hvdtrain-smoke-worker-0", url="http://127.0.0.1:9")
        assert rc == 4 and line.startswith("cannot reach the API server http://127.0.0.1:9 ("), line
        assert line.endswith("kubectl delete pod hvdtrain-smoke-worker-0 -n default"), line
    finally:
        api.close()
