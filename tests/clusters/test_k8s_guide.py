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
SMOKE = K.applied_job(
    block(
        "guides/clusters/kubernetes.md", "kubectl apply -k deploy/kubernetes/overlays/smoke "
    ).commands()[0]
)


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
    assert {
        f for f in named if os.path.exists(os.path.join(K.DEPLOY, f, "kustomization.yaml"))
    } == set(OVERLAYS)
    for folder, what in named.items():
        for name in re.findall(r"[\w/-]+\.(?:sh|md)\b", what):
            assert os.path.exists(os.path.join(K.DEPLOY, folder, name)) or os.path.exists(
                os.path.join(K.ROOT, "scripts", os.path.basename(name))
            ), name
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
    (cmd,) = block(
        "guides/clusters/kubernetes.md", "kubectl get mpijob hvdtrain-smoke -o jsonpath="
    ).commands()
    words = shlex.split(cmd)
    assert words[:4] == ["kubectl", "get", "mpijob", SMOKE["metadata"]["name"]], words
    assert words[4:6] == ["-o", words[5]] and words[5].startswith("jsonpath="), words
    return words[5][len("jsonpath=") :]


# kubectl's names of the kinds the guide's commands use (`kubectl api-resources` on a cluster).
KINDS = {
    "sc": "StorageClass",
    "pvc": "PersistentVolumeClaim",
    "crd": "CustomResourceDefinition",
    "pods": "Pod",
    "mpijob": "MPIJob",
    "job": "Job",
}


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
    blocks = [
        block("guides/clusters/kubernetes.md", "kubectl apply --server-side -f "),
        block("guides/clusters/kubernetes.md", "kubectl get sc "),
        block(
            "guides/clusters/kubernetes.md", "kubectl apply -k deploy/kubernetes/overlays/smoke "
        ),
        block("guides/clusters/kubernetes.md", "kubectl delete mpijob hvdtrain "),
    ]
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
                block_jobs.update(
                    {d["metadata"]["name"]: d for d in K.rendered(path) if d["kind"] == "MPIJob"}
                )
        for words in commands:
            if have_kubectl and words[1] not in flags:
                flags[words[1]] = kubectl_flags(words[1])
            verb, given, args = kubectl_command(words, flags.get(words[1]))
            seen.add(verb)
            if verb in ("apply", "delete") and "-k" in given:
                assert args == [], words
                made = {
                    d["metadata"]["name"]: d
                    for d in K.rendered(
                        os.path.relpath(os.path.join(K.ROOT, given["-k"]), K.DEPLOY)
                    )
                    if d["kind"] == "MPIJob"
                }
                if verb == "apply":
                    jobs.update(made)
                else:
                    assert made and all(jobs.pop(name, None) for name in made), words
            elif verb == "apply":
                assert args == [] and given == {
                    "--server-side": "",
                    "-f": (
                        f"https://raw.githubusercontent.com/kubeflow/mpi-operator/{release}/"
                        f"{operator_file}"
                    ),
                }, words
            elif verb in ("logs", "wait"):
                kind, name = args[0].split("/")
                assert KINDS[kind] == "Job" and name in [
                    K.operator_objects(j)["launcher"]["metadata"]["name"] for j in jobs.values()
                ]
            elif args[:1] == ["pods"]:
                key, value = given["-l"].split("=")  # every pod of one of those jobs
                selected = []
                for made in map(K.operator_objects, jobs.values()):
                    pods = [p["metadata"]["labels"] for p in made["workers"]] + [
                        made["launcher"]["spec"]["template"]["metadata"]["labels"]
                    ]
                    if all(labels.get(key) == value for labels in pods):
                        selected.append(made)
                assert len(selected) == 1, words
            else:
                kind, names = KINDS[args[0]], args[1:]
                want = {
                    "StorageClass": [],
                    "CustomResourceDefinition": [f"mpijobs.{group}"],
                    "PersistentVolumeClaim": [claim["metadata"]["name"]],
                    "MPIJob": [
                        n for n in names[:1] if n in (block_jobs if verb == "delete" else jobs)
                    ],
                }
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
    job["status"] = {
        "conditions": [
            {
                "type": "Created",
                "status": "True",
                "reason": "MPIJobCreated",
                "message": "MPIJob default/hvdtrain-smoke is created.",
            },
            {
                "type": "Running",
                "status": "False",
                "reason": "MPIJobRunning",
                "message": "MPIJob default/hvdtrain-smoke is running.",
            },
            {
                "type": "Failed",
                "status": "True",
                "reason": "MPIJobEvicted",
                "message": "launcher pod was evicted",
            },
        ],
        "startTime": "2026-01-01T00:00:00Z",
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    p = subprocess.run(
        [
            "kubectl",
            "label",
            "--local",
            "-f",
            str(path),
            "x=y",
            "-o",
            f"jsonpath={documented_status_command()}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "Created=True MPIJobCreated: MPIJob default/hvdtrain-smoke is created.",
        "Running=False MPIJobRunning: MPIJob default/hvdtrain-smoke is running.",
        "Failed=True MPIJobEvicted: launcher pod was evicted",
        "completionTime: ",
    ], p.stdout


GUIDE = "guides/clusters/kubernetes.md"
INSPECT = os.path.join(K.DEPLOY, "inspect", "pod.yaml")


def base_pods():
    """The launcher's and a worker's pod spec as the operator makes them from the base MPIJob."""
    made = K.operator_objects(K.mpijob(K.rendered("base")))
    return made["launcher"]["spec"]["template"]["spec"], made["workers"][0]["spec"]


def claim_of(pod_spec):
    """(claim name, mount path) of the pod's claim volume."""
    (v,) = [v for v in pod_spec["volumes"] if "persistentVolumeClaim" in v]
    (m,) = [m for m in pod_spec["containers"][0]["volumeMounts"] if m["name"] == v["name"]]
    return v["persistentVolumeClaim"]["claimName"], m["mountPath"]


@pytest.mark.quick
def test_k8s_the_inspect_pod_is_the_jobs_user_on_the_jobs_claim():
    """deploy/kubernetes/inspect/pod.yaml: a valid Pod (the Kubernetes API schemas, strict)
    that mounts the job's claim where the job's pods do, as their user, with their pod and
    container securityContext (the restricted profile), no API token, and an end of its own."""
    with open(INSPECT) as f:
        (pod,) = [d for d in yaml.safe_load_all(f) if d]
    assert (pod["apiVersion"], pod["kind"]) == ("v1", "Pod")
    assert K.api_errors(pod) == []
    spec = pod["spec"]
    for job_pod in base_pods():
        assert (
            claim_of(spec)
            == claim_of(job_pod)
            == (K.rendered("claim")[0]["metadata"]["name"], K.RUNS)
        )
        assert spec["securityContext"] == job_pod["securityContext"]
        assert (
            spec["containers"][0]["securityContext"] == job_pod["containers"][0]["securityContext"]
        )
    assert spec["securityContext"]["runAsUser"] == 1000
    assert spec["automountServiceAccountToken"] is False
    assert spec["restartPolicy"] == "Never" and 0 < spec["activeDeadlineSeconds"] <= 24 * 3600
    (c,) = spec["containers"]
    assert c["command"][0] == "sleep" and int(c["command"][1]) >= spec["activeDeadlineSeconds"]


def exec_command(words, pod_name):
    """``kubectl exec POD -- CMD ARGS``: CMD ARGS."""
    assert words[:3] == ["kubectl", "exec", pod_name] and words[3] == "--", words
    return words[4:]


@pytest.mark.quick
@pytest.mark.parametrize(
    "inspect",
    [
        block(
            "guides/clusters/kubernetes.md",
            "kubectl apply -f deploy/kubernetes/inspect/pod.yaml\n"
            "kubectl wait --for=condition=Ready pod/hvdtrain-inspect --timeout=5m\n"
            "kubectl exec hvdtrain-inspect -- ls",
        ),
        block(
            "guides/clusters/kubernetes.md",
            "kubectl apply -f deploy/kubernetes/inspect/pod.yaml\n"
            "kubectl wait --for=condition=Ready pod/hvdtrain-inspect --timeout=5m\n"
            "kubectl exec hvdtrain-inspect -- cat /opt/hvdtrain/runs/hvdtrain-mnist/k8s-launcher-",
        ),
    ],
    ids=["result", "marker"],
)
def test_k8s_the_guides_inspect_commands_name_the_pod_and_the_run_directory(inspect):
    """The inspect blocks: the manifest applied is the inspect pod's; each command names that
    pod; every flag is kubectl's (where it is installed); what they read or remove is in the
    base MPIJob's run directory on the claim: its result.json (hvdtrain writes that name),
    its k8s-launcher-failed (k8s_launcher.sh's); the pod deleted at the end."""
    with open(INSPECT) as f:
        name = yaml.safe_load(f)["metadata"]["name"]
    args = K.containers(K.mpijob(K.rendered("base")), "Launcher")[0]["args"]
    run_dir = args[args.index("--run-dir") + 1]
    assert run_dir.startswith(K.RUNS + "/")
    launcher = open(os.path.join(K.ROOT, "scripts", "k8s_launcher.sh")).read()
    commands = [shlex.split(c) for c in inspect.commands()]
    assert commands[0] == ["kubectl", "apply", "-f", os.path.relpath(INSPECT, K.ROOT)]
    assert commands[1] == [
        "kubectl",
        "wait",
        "--for=condition=Ready",
        f"pod/{name}",
        "--timeout=5m",
    ]
    assert commands[-1] == ["kubectl", "delete", "pod", name]
    if shutil.which("kubectl"):
        for words in commands[:2]:
            kubectl_command(words, kubectl_flags(words[1]))
    for words in commands[2:-1]:
        cmd, *paths = exec_command(words, name)
        assert cmd in ("ls", "cat", "rm") and len(paths) == 1, words
        assert os.path.dirname(paths[0]) == run_dir or paths[0] == run_dir, words
        if cmd == "rm":
            assert os.path.basename(paths[0]) == "k8s-launcher-failed"
            assert "marker=$run_dir/k8s-launcher-failed" in launcher
        elif cmd == "cat" and paths[0].endswith("result.json"):
            p = subprocess.run(["grep", "-rlq", '"result.json"', os.path.join(K.ROOT, "hvdtrain")])
            assert p.returncode == 0


@pytest.mark.quick
def test_k8s_the_guides_failed_worker_text_is_the_role_and_the_launchers_line():
    """The "worker left Failed" part: the Role it describes is base/rbac.yaml's (get and
    delete on the base MPIJob's worker pods, by name); the launcher's line it shows is the one
    scripts/k8s_pods.py prints, for one of those pods; the commands for a cluster without the
    Role list the base job's Failed pods and delete one of its workers (kubectl's flags)."""
    text = open(os.path.join(K.ROOT, "docs", GUIDE)).read()
    docs = K.rendered("base")
    job = K.mpijob(docs)
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    m = re.search(
        r"the ServiceAccount `([\w-]+)` \(`base/(\w+\.yaml)`\), bound\nto a Role that "
        r"allows `(\w+)` and `(\w+)` on `(\w+)` named `([\w-]+)` and\n`([\w-]+)`",
        text,
    )
    assert m, "the guide's description of the Role"
    assert m.group(1) == sa["metadata"]["name"]
    assert os.path.exists(os.path.join(K.DEPLOY, "base", m.group(2)))
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": [m.group(5)],
            "verbs": [m.group(3), m.group(4)],
            "resourceNames": [m.group(6), m.group(7)],
        }
    ]
    assert [m.group(6), m.group(7)] == K.worker_names(job)
    (line,) = block(
        "guides/clusters/kubernetes.md", "k8s_launcher.sh: worker pod "
    ).text.splitlines()
    said = re.fullmatch(
        r"k8s_launcher\.sh: worker pod ([\w-]+) is Failed \(Evicted: [^()]+\): "
        r"(deleted it, the operator re-creates it)",
        line,
    )
    assert said and said.group(1) in K.worker_names(job), line
    client = open(os.path.join(K.ROOT, "scripts", "k8s_pods.py")).read()
    assert f'is Failed ({{what}}): {said.group(2)}")' in client
    get, delete = [
        shlex.split(c)
        for c in block(
            "guides/clusters/kubernetes.md",
            "kubectl get pods -l training.kubeflow.org/job-name=hvdtrain ",
        ).commands()
    ]
    flags = {v: kubectl_flags(v) for v in ("get", "delete")} if shutil.which("kubectl") else {}
    verb, given, args = kubectl_command(get, flags.get("get"))
    assert (verb, args) == ("get", ["pods"]) and given == {
        "-l": f"training.kubeflow.org/job-name={job['metadata']['name']}",
        "--field-selector": "status.phase=Failed",
    }, get
    labels = K.operator_objects(job)["workers"][0]["metadata"]["labels"]
    assert labels["training.kubeflow.org/job-name"] == job["metadata"]["name"]
    verb, given, args = kubectl_command(delete, flags.get("delete"))
    assert (
        verb == "delete"
        and given == {}
        and args[0] == "pod"
        and args[1:] == [said.group(1)]
        and args[1] in role["rules"][0]["resourceNames"]
    ), delete


@pytest.mark.quick
def test_k8s_the_retry_timing_text_is_the_job_controllers_back_off():
    """Every statement of the retries' timing in the guide, the base MPIJob and the smoke
    overlay, against the Job controller's back-off (k8s_cluster.job_backoff: 10 s, doubling,
    at most 6 min): the text cannot drift from it."""
    from k8s_cluster import job_backoff

    waits = lambda n: sum(job_backoff(i) for i in range(1, n + 1))  # noqa: E731
    texts = {}  # each file's text as one line, without the comments' "#"
    for name in (
        os.path.join("docs", GUIDE),
        "deploy/kubernetes/base/mpijob.yaml",
        "deploy/kubernetes/overlays/smoke/task.yaml",
        "scripts/k8s_launcher.sh",
    ):
        with open(os.path.join(K.ROOT, name)) as f:
            texts[name] = " ".join(re.sub(r"^\s*#", "", line) for line in f.read().split("\n"))
            texts[name] = " ".join(texts[name].split())
    guide = texts[os.path.join("docs", GUIDE)]
    rules = {}
    for name, text in texts.items():
        rules[name] = 0
        for first, most in re.findall(r"(\d+) s,? doubling,? (?:at most|to|up to) (\d+) min", text):
            assert (job_backoff(1), job_backoff(2)) == (int(first), 2 * int(first))
            assert max(job_backoff(i) for i in range(1, 100)) == int(most) * 60
            rules[name] += 1
        for *seq, most in re.findall(
            r"waits (\d+) s, (\d+) s, (\d+) s \.\.\. \(at most (\d+) min\)", text
        ):
            assert [job_backoff(i) for i in (1, 2, 3)] == list(map(int, seq))
            assert max(job_backoff(i) for i in range(1, 100)) == int(most) * 60
            rules[name] += 1
        for n, minutes in re.findall(r"(\d+) retries take about (\d+) minutes", text) + re.findall(
            r"with `backoffLimit: (\d+)` the MPIJob is `Failed` about (\d+) "
            r"minutes later",
            text,
        ):
            assert abs(waits(int(n)) / 60 - int(minutes)) <= 0.5, (name, n, minutes)  # "about"
            rules[name] += 1
        for n in re.findall(r"(\d+) retries end in about half a minute", text):
            assert waits(int(n)) == 30, (name, n)
            rules[name] += 1
    m = re.search(
        r"the first five retries wait about (\d+) minutes in all, the sixth about (\d+) "
        r"minutes and each later one (\d+) minutes",
        guide,
    )
    assert m, "the guide's retry waits"
    assert (
        abs(waits(5) / 60 - int(m.group(1))) <= 0.5
        and abs(job_backoff(6) / 60 - int(m.group(2))) <= 0.5
    ), m.groups()
    assert all(job_backoff(i) == int(m.group(3)) * 60 for i in range(7, 30)), m.groups()
    # The statements found: the guide's, the manifests' and the launcher's (none dropped).
    assert list(rules.values()) == [4, 2, 2, 2], rules
    base = K.mpijob(K.rendered("base"))["spec"]["runPolicy"]["backoffLimit"]
    assert f"with `backoffLimit: {base}`" in guide
    smoke = K.mpijob(K.rendered("overlays/smoke"))["spec"]["runPolicy"]["backoffLimit"]
    assert (
        f"so {smoke} retries end in about half a minute"
        in texts["deploy/kubernetes/overlays/smoke/task.yaml"]
    )
