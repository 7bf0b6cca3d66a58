"""The Kubernetes guide (docs/guides/clusters/kubernetes.md) against deploy/kubernetes/: its
folder picture is the tree, its kubectl commands name what the manifests make (every flag in
``kubectl VERB --help``, every path, CRD, claim, job and label as rendered, the operator's URL
at the schema's version), and its status command, evaluated offline by ``kubectl label --local``
on a status as the operator writes it, shows the job's conditions.
"""
import copy
import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

import k8s_manifests as K
from docs_pages import block

pytestmark = pytest.mark.k8s

OVERLAYS = K.overlays()


# What the guide's first command of a run applies (`kubectl apply -k .../overlays/smoke`).
SMOKE = K.applied_job(block("guides/clusters/kubernetes.md",
                            "kubectl apply -k deploy/kubernetes/overlays/smoke ").commands()[0])


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
            spec = K.mpijob(K.rendered(folder))["spec"]
            assert spec["mpiReplicaSpecs"]["Worker"]["replicas"] == int(m.group(1)), folder
            if m.group(2):
                assert spec["slotsPerWorker"] == int(m.group(2)), folder
            if m.group(3) == "GPUs":
                (worker,) = K.containers(K.mpijob(K.rendered(folder)), "Worker")
                assert worker["resources"]["limits"]["nvidia.com/gpu"] == int(m.group(2))
        for mode in re.findall(r"ReadWrite\w+", what):
            assert K.rendered(folder)[0]["spec"]["accessModes"] == [mode], folder
    assert "2 workers" in named["base"] and "ReadWriteMany" in named["claim"]


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
    (claim,) = K.rendered("claim")
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
                block_jobs.update({d["metadata"]["name"]: d for d in K.rendered(path)
                                   if d["kind"] == "MPIJob"})
        for words in commands:
            if have_kubectl and words[1] not in flags:
                flags[words[1]] = kubectl_flags(words[1])
            verb, given, args = kubectl_command(words, flags.get(words[1]))
            seen.add(verb)
            if verb in ("apply", "delete") and "-k" in given:
                assert args == [], words
                made = {d["metadata"]["name"]: d for d in K.rendered(os.path.relpath(
                    os.path.join(K.ROOT, given["-k"]), K.DEPLOY)) if d["kind"] == "MPIJob"}
                if verb == "apply":
                    jobs.update(made)
                else:
                    assert made and all(jobs.pop(name, None) for name in made), words
            elif verb == "apply":
                assert args == [] and given == {"--server-side": "", "-f": (
                    f"https://raw.githubusercontent.com/kubeflow/mpi-operator/{release}/"
                    f"{operator_file}")}, words
            elif verb in ("logs", "wait"):
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
    assert seen == {"apply", "get", "describe", "wait", "logs", "delete"}
    # The claim's required edit names the same command for the classes.
    assert "(kubectl get sc)" in K.deploy_errors(K.rendered("claim"))[0]


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
