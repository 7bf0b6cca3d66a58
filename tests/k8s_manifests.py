"""deploy/kubernetes/ offline: render it, make what the MPI Operator makes of it, validate both.

- ``render(dir)``: a small kustomize for the features deploy/kubernetes/ uses (``resources``,
  ``images``, ``patches`` as RFC 6902 JSON patches with a kind/name target, ``namePrefix``,
  ``nameSuffix``); anything else in a kustomization.yaml is refused, not ignored. Where
  ``kubectl`` is installed, tests/clusters/test_k8s_manifests.py checks that ``kubectl kustomize`` renders the
  same objects.
- ``operator_objects(mpijob)``: the Service, ConfigMap (hostfile, discover_hosts.sh), ssh
  Secret, worker Pods and launcher Job that the Kubeflow MPI Operator (v0.8.2,
  pkg/controller/mpi_job_controller.go) creates for an MPIJob, field by field as its
  newWorker, newLauncherJob and newLauncherPodTemplate do: host names, subdomain, DNS search,
  restart policy, the environment it adds, the key pair's and the hostfile's volumes.
- ``crd_errors``: jsonschema against the MPIJob CRD's own schema
  (deploy/kubernetes/schema/), strict as the API server's field validation is by default
  (unknown fields are errors); ``operator_errors``: the operator's own validation
  (pkg/apis/kubeflow/validation/validation.go, after its defaulting), which rejects an MPIJob
  the CRD schema lets in (an event, and the job never starts); ``api_errors``: the
  ``kubernetes-validate`` package's Kubernetes API schemas (strict) for the built-in objects.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")
SCHEMA = os.path.join(DEPLOY, "schema", "mpijob-kubeflow-v2beta1.json")
# The Kubernetes versions the built-in objects are validated against: the oldest one with the
# launcher Job's podReplacementPolicy on by default (1.29), and the newest kubernetes-validate has.
API_VERSIONS = ("1.29", "latest")

KUSTOMIZE_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "images",
    "patches",
    "namePrefix",
    "nameSuffix",
}


# kustomize's output order (its "legacy" sort), for the kinds that come first; the rest after
# them, in order.
LEGACY_ORDER = [
    "Namespace",
    "ResourceQuota",
    "StorageClass",
    "CustomResourceDefinition",
    "ServiceAccount",
    "PodSecurityPolicy",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "Endpoints",
    "Service",
    "LimitRange",
    "PriorityClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Deployment",
    "StatefulSet",
    "CronJob",
    "PodDisruptionBudget",
]


class Unsupported(ValueError):
    """A kustomization feature or patch operation this renderer does not implement."""


# --- rendering ----------------------------------------------------------------------------------
def render(directory: str) -> list:
    """The objects ``kubectl kustomize directory`` would print, in order."""
    with open(os.path.join(directory, "kustomization.yaml")) as f:
        k = yaml.safe_load(f)
    unknown = set(k) - KUSTOMIZE_KEYS
    if unknown:
        raise Unsupported(f"{directory}/kustomization.yaml: {sorted(unknown)}")
    docs = []
    for entry in k.get("resources", []):
        path = os.path.normpath(os.path.join(directory, entry))
        if os.path.isdir(path):
            docs += render(path)
        else:
            with open(path) as f:
                docs += [d for d in yaml.safe_load_all(f) if d]
    for patch in k.get("patches", []):
        if set(patch) - {"path", "patch", "target"} or set(patch.get("target", {})) - {
            "kind",
            "name",
        }:
            raise Unsupported(f"patch {patch}")
        if "path" in patch:
            with open(os.path.join(directory, patch["path"])) as f:
                ops = yaml.safe_load(f)
        else:
            ops = yaml.safe_load(patch["patch"])
        if not isinstance(ops, list):
            raise Unsupported(f"{patch}: only JSON patches (a list of operations)")
        target = patch.get("target", {})
        hits = [
            d
            for d in docs
            if d.get("kind") == target.get("kind", d.get("kind"))
            and d["metadata"]["name"] == target.get("name", d["metadata"]["name"])
        ]
        if not hits:
            raise ValueError(f"{directory}: patch {patch} matches no resource")
        for d in hits:
            json_patch(d, ops)
    for image in k.get("images", []):
        for d in docs:
            set_image(d, image)
    renamed = {}  # (kind, old name) -> new name
    for d in docs:
        new = k.get("namePrefix", "") + d["metadata"]["name"] + k.get("nameSuffix", "")
        renamed[(d["kind"], d["metadata"]["name"])] = new
        d["metadata"]["name"] = new
    # kustomize's name references for the kinds here: a RoleBinding's Role and ServiceAccounts
    # (not an MPIJob's serviceAccountName: kustomize does not know that field).
    for d in docs:
        if d["kind"] == "RoleBinding":
            ref = d["roleRef"]
            ref["name"] = renamed.get((ref["kind"], ref["name"]), ref["name"])
            for subject in d.get("subjects", []):
                subject["name"] = renamed.get((subject["kind"], subject["name"]), subject["name"])
    return sorted(
        docs,
        key=lambda d: (
            LEGACY_ORDER.index(d["kind"]) if d["kind"] in LEGACY_ORDER else len(LEGACY_ORDER)
        ),
    )


def _pointer(path: str) -> list:
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(doc: dict, ops: list) -> None:
    """RFC 6902 add, replace and remove, in place."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        kind = op["op"]
        if kind == "add":
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                node[last] = copy.deepcopy(op["value"])
        elif kind == "replace":
            if isinstance(node, list):
                node[int(last)] = copy.deepcopy(op["value"])
            else:
                if last not in node:
                    raise KeyError(f"replace {op['path']}: no such field")
                node[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise Unsupported(f"JSON patch op {kind!r}")


def set_image(node, image: dict) -> None:
    """kustomize's ``images``: every container's image named ``image['name']`` (any tag), to
    ``newName`` with ``newTag``, or pinned as ``newName@digest``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    name, _, tag = c.get("image", "").split("@")[0].partition(":")
                    if name == image["name"]:
                        name = image.get("newName", name)
                        tag = image.get("newTag", tag)
                        c["image"] = (
                            f"{name}@{image['digest']}"
                            if image.get("digest")
                            else f"{name}:{tag}"
                            if tag
                            else name
                        )
            set_image(value, image)
    elif isinstance(node, list):
        for v in node:
            set_image(v, image)


def overlays() -> dict:
    """{name: directory} of every kustomization under deploy/kubernetes/ but the bases."""
    found = {}
    for dirpath, _, files in os.walk(DEPLOY):
        if "kustomization.yaml" in files:
            found[os.path.relpath(dirpath, DEPLOY)] = dirpath
    return found


def mpijob(docs: list) -> dict:
    (job,) = [d for d in docs if d["kind"] == "MPIJob"]
    return job


# The claim's mount path in every pod.
RUNS = "/opt/hvdtrain/runs"


def rendered(name: str) -> list:
    """The objects of the kustomization ``name`` (a key of ``overlays()``, e.g. "overlays/cpu")."""
    return render(os.path.join(DEPLOY, name))


def containers(job: dict, role: str) -> list:
    """The containers of an MPIJob's ``role`` ("Launcher" or "Worker")."""
    return job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"]


def applied(command: str) -> list:
    """The objects that ``kubectl apply -k DIR`` (a line of the Kubernetes guide, DIR from the
    checkout's root) applies."""
    words = shlex.split(command)
    assert words[:3] == ["kubectl", "apply", "-k"], command
    return render(os.path.join(ROOT, words[3]))


def applied_job(command: str) -> dict:
    """The MPIJob that ``kubectl apply -k DIR`` (a line of the Kubernetes guide, DIR from the
    checkout's root) applies."""
    words = shlex.split(command)
    assert words[:3] == ["kubectl", "apply", "-k"], command
    return mpijob(render(os.path.join(ROOT, words[3])))


# --- what the operator makes of an MPIJob -------------------------------------------------------
def defaulted(job: dict) -> dict:
    """The MPIJob after the operator's SetDefaults_MPIJob (pkg/apis/kubeflow/v2beta1/default.go)."""
    job = copy.deepcopy(job)
    spec = job["spec"]
    spec.setdefault("runPolicy", {}).setdefault("cleanPodPolicy", "None")
    spec.setdefault("slotsPerWorker", 1)
    spec.setdefault("sshAuthMountPath", "/root/.ssh")
    spec.setdefault("mpiImplementation", "OpenMPI")
    spec.setdefault("launcherCreationPolicy", "AtStartup")
    specs = spec.get("mpiReplicaSpecs") or {}
    if specs.get("Launcher") is not None:
        specs["Launcher"].setdefault("restartPolicy", "OnFailure")
        specs["Launcher"].setdefault("replicas", 1)
    if specs.get("Worker") is not None:
        specs["Worker"].setdefault("restartPolicy", "Never")
        specs["Worker"].setdefault("replicas", 0)
    return job


DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def operator_errors(job: dict) -> list:
    """What the operator's ValidateMPIJob says of the (defaulted) MPIJob; [] if it runs it."""
    job = defaulted(job)
    spec, errs = job["spec"], []
    workers = (spec.get("mpiReplicaSpecs") or {}).get("Worker") or {}
    n = workers.get("replicas") or 1
    last = f"{job['metadata']['name']}-worker-{n - 1}"
    if not (len(last) <= 63 and DNS1035.match(last)):
        errs.append(f"metadata.name: pod and service name {last!r} is not a DNS-1035 label")
    if spec["slotsPerWorker"] < 0:
        errs.append("spec.slotsPerWorker: must be >= 0")
    policy = spec["runPolicy"]
    if policy["cleanPodPolicy"] not in ("None", "Running", "All"):
        errs.append(f"spec.runPolicy.cleanPodPolicy: {policy['cleanPodPolicy']!r} not supported")
    for field in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        if policy.get(field) is not None and policy[field] < 0:
            errs.append(f"spec.runPolicy.{field}: must be >= 0")
    if policy.get("managedBy") not in (
        None,
        "kubeflow.org/mpi-operator",
        "kueue.x-k8s.io/multikueue",
    ):
        errs.append(f"spec.runPolicy.managedBy: {policy['managedBy']!r} not supported")
    if not spec["sshAuthMountPath"]:
        errs.append("spec.sshAuthMountPath: required")
    if spec["mpiImplementation"] not in ("OpenMPI", "Intel", "MPICH"):
        errs.append(f"spec.mpiImplementation: {spec['mpiImplementation']!r} not supported")
    specs = spec.get("mpiReplicaSpecs")
    if not specs:
        return errs + ["spec.mpiReplicaSpecs: required"]
    for role in ("Launcher", "Worker"):
        rs = specs.get(role)
        where = f"spec.mpiReplicaSpecs[{role}]"
        if rs is None:
            if role == "Launcher":
                errs.append(f"{where}: required")
            continue
        if rs.get("replicas") is None:
            errs.append(f"{where}.replicas: required")
        # Never and OnFailure only: the API type's "ExitCode" (and "Always") are refused here.
        if rs.get("restartPolicy") not in ("Never", "OnFailure"):
            errs.append(
                f"{where}.restartPolicy: {rs.get('restartPolicy')!r} not supported "
                "(Never, OnFailure)"
            )
        if not ((rs.get("template") or {}).get("spec") or {}).get("containers"):
            errs.append(f"{where}.template.spec.containers: at least one container")
        if role == "Launcher" and rs.get("replicas") not in (None, 1):
            errs.append(f"{where}.replicas: must be 1")
        if role == "Worker" and rs.get("replicas") is not None and rs["replicas"] <= 0:
            errs.append(f"{where}.replicas: must be >= 1")
    return errs


OMPI_ENV = [  # ompiEnvVars, then the slots variable
    ("OMPI_MCA_orte_keep_fqdn_hostnames", "true"),
    ("OMPI_MCA_orte_default_hostfile", "/etc/mpi/hostfile"),
    ("OMPI_MCA_plm_rsh_args", "-o ConnectionAttempts=10"),
]


def operator_objects(job: dict, namespace: str = "default", cluster_domain: str = "") -> dict:
    """What the operator creates for ``job``: service, configmap, secret, workers, launcher."""
    job = defaulted(job)
    name, spec = job["metadata"]["name"], job["spec"]
    slots = spec["slotsPerWorker"]
    specs = spec["mpiReplicaSpecs"]
    n_workers = specs.get("Worker", {}).get("replicas", 0)
    as_worker = bool(spec.get("runLauncherAsWorker"))
    owner = [
        {
            "apiVersion": "kubeflow.org/v2beta1",
            "kind": "MPIJob",
            "name": name,
            "uid": "00000000-0000-0000-0000-000000000000",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    domain = "%s.%s.%s.svc" + (f".{cluster_domain}" if cluster_domain else "")
    hosts = ([f"{name}-launcher"] if as_worker else []) + [
        f"{name}-worker-{i}" for i in range(n_workers)
    ]
    fmt = "{} slots={}\n" if spec["mpiImplementation"] == "OpenMPI" else "{}:{}\n"
    hostfile = "".join(fmt.format(domain % (h, name, namespace), slots) for h in hosts)
    # discover_hosts.sh lists the running workers (all of them, once they run), no slots.
    discover = "#!/bin/sh\n" + "".join(f"echo {domain % (h, name, namespace)}\n" for h in hosts)

    def labels(role):
        return {
            "training.kubeflow.org/operator-name": "mpi-operator",
            "training.kubeflow.org/job-name": name,
            "training.kubeflow.org/job-role": role,
        }

    def meta(n, **extra):
        return {
            "name": n,
            "namespace": namespace,
            "labels": {"app": name},
            "ownerReferences": owner,
            **extra,
        }

    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name),
        "spec": {
            "clusterIP": "None",
            "selector": {
                k: v for k, v in labels("x").items() if k != "training.kubeflow.org/job-role"
            },
            "publishNotReadyAddresses": as_worker,
        },
    }
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(f"{name}-config"),
        "data": {"hostfile": hostfile, "discover_hosts.sh": discover},
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(f"{name}-ssh"),
        "type": "kubernetes.io/ssh-auth",
        "data": {"ssh-privatekey": "LS0tLS1CRUdJTi==", "ssh-publickey": "ZWNkc2E="},
    }

    def ssh(pod_spec):
        mode = 0o600 if spec["sshAuthMountPath"] == "/root/.ssh" else None
        secret_volume = {
            "secretName": f"{name}-ssh",
            "items": [
                {"key": "ssh-privatekey", "path": "id_rsa"},
                {"key": "ssh-publickey", "path": "id_rsa.pub"},
                {"key": "ssh-publickey", "path": "authorized_keys"},
            ],
        }
        if mode is not None:
            secret_volume["defaultMode"] = mode
        pod_spec.setdefault("volumes", []).append({"name": "ssh-auth", "secret": secret_volume})
        pod_spec["containers"][0].setdefault("volumeMounts", []).append(
            {"name": "ssh-auth", "mountPath": spec["sshAuthMountPath"]}
        )

    workers = []
    for i in range(n_workers):
        t = copy.deepcopy(specs["Worker"]["template"])
        pod_labels = {
            **t.get("metadata", {}).get("labels", {}),
            **labels("worker"),
            "training.kubeflow.org/replica-index": str(i + 1 if as_worker else i),
        }
        ps = t["spec"]
        ps["hostname"], ps["subdomain"] = f"{name}-worker-{i}", name
        if ps.get("hostNetwork"):
            ps["dnsPolicy"] = "ClusterFirstWithHostNet"
        ps.setdefault("dnsConfig", {}).setdefault("searches", []).append(
            f"{name}.{namespace}.svc.cluster.local"
        )
        ps["restartPolicy"] = specs["Worker"]["restartPolicy"]
        c = ps["containers"][0]
        if not c.get("command") and not c.get("args"):
            c["command"] = ["/usr/sbin/sshd", "-De"]
        c.setdefault("env", []).append({"name": "K_MPI_JOB_ROLE", "value": "worker"})
        ssh(ps)
        workers.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{name}-worker-{i}",
                    "namespace": namespace,
                    "labels": pod_labels,
                    "ownerReferences": owner,
                    **(
                        {"annotations": t["metadata"]["annotations"]}
                        if t.get("metadata", {}).get("annotations")
                        else {}
                    ),
                },
                "spec": ps,
            }
        )

    t = copy.deepcopy(specs["Launcher"]["template"])
    ps = t["spec"]
    ps["hostname"], ps["subdomain"] = f"{name}-launcher", name
    if ps.get("hostNetwork"):
        ps["dnsPolicy"] = "ClusterFirstWithHostNet"
    c = ps["containers"][0]
    env = c.setdefault("env", [])
    env.append({"name": "K_MPI_JOB_ROLE", "value": "launcher"})
    if spec["mpiImplementation"] == "OpenMPI":
        env += [{"name": k, "value": v} for k, v in OMPI_ENV]
        env.append({"name": "OMPI_MCA_orte_set_default_slots", "value": str(slots)})
    else:
        raise Unsupported(f"mpiImplementation {spec['mpiImplementation']}")
    if not as_worker:  # no GPU for a launcher that runs no rank
        env += [{"name": "NVIDIA_VISIBLE_DEVICES"}, {"name": "NVIDIA_DRIVER_CAPABILITIES"}]
    ssh(ps)
    ps["restartPolicy"] = specs["Launcher"]["restartPolicy"]
    ps["volumes"].append(
        {
            "name": "mpi-job-config",
            "configMap": {
                "name": f"{name}-config",
                "items": [
                    {"key": "hostfile", "path": "hostfile", "mode": 0o444},
                    {"key": "discover_hosts.sh", "path": "discover_hosts.sh", "mode": 0o555},
                ],
            },
        }
    )
    c["volumeMounts"].append({"name": "mpi-job-config", "mountPath": "/etc/mpi"})
    policy = spec["runPolicy"]
    job_spec = {
        "template": {
            "metadata": {
                "labels": {**t.get("metadata", {}).get("labels", {}), **labels("launcher")}
            },
            "spec": ps,
        },
        "podReplacementPolicy": "Failed",
    }
    for ours, theirs in (
        ("backoffLimit", "backoffLimit"),
        ("activeDeadlineSeconds", "activeDeadlineSeconds"),
        ("ttlSecondsAfterFinished", "ttlSecondsAfterFinished"),
    ):
        if policy.get(ours) is not None:
            job_spec[theirs] = policy[ours]
    if policy.get("suspend"):
        job_spec["suspend"] = True
    launcher = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta(f"{name}-launcher"),
        "spec": job_spec,
    }
    return {
        "service": service,
        "configmap": configmap,
        "secret": secret,
        "workers": workers,
        "launcher": launcher,
        "hostfile": hostfile,
    }


# --- schema checks ------------------------------------------------------------------------------
def strip_descriptions(x):
    if isinstance(x, dict):
        return {k: strip_descriptions(v) for k, v in x.items() if k != "description"}
    if isinstance(x, list):
        return [strip_descriptions(v) for v in x]
    return x


def strict(schema):
    """The CRD's schema as strict field validation applies it: an object's fields are the ones
    it declares (unless it preserves unknown fields or declares additionalProperties)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


_validator = None


def crd_validator():
    global _validator
    if _validator is None:
        import jsonschema

        with open(SCHEMA) as f:
            schema = json.load(f)
        schema.pop("$comment", None)
        _validator = jsonschema.Draft7Validator(strict(schema))
    return _validator


def crd_errors(job: dict) -> list:
    """The MPIJob against its CRD's schema; ["path: message", ...], [] when valid."""
    if (job.get("apiVersion"), job.get("kind")) != ("kubeflow.org/v2beta1", "MPIJob"):
        return [f"not a kubeflow.org/v2beta1 MPIJob: {job.get('apiVersion')} {job.get('kind')}"]
    errs = []
    for e in sorted(crd_validator().iter_errors(job), key=lambda e: list(map(str, e.path))):
        errs.append(f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}")
    name = (job.get("metadata") or {}).get("name", "")
    if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$", name):
        errs.append(f"metadata.name: {name!r} is not a DNS subdomain")
    return errs


def api_errors(obj: dict) -> list:
    """A built-in object against the Kubernetes API schemas (kubernetes-validate, strict)."""
    import kubernetes_validate

    errs = []
    for version in API_VERSIONS:
        v = kubernetes_validate.latest_version() if version == "latest" else version
        try:
            kubernetes_validate.validate(obj, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(map(str, e.path)) or "(top)"
            errs.append(
                f"{obj['kind']} {obj['metadata']['name']} (Kubernetes {e.version}): "
                f"{path}: {e.message}"
            )
    return errs


def worker_names(job: dict) -> list:
    """The MPIJob's worker pod names, as the operator names them."""
    n = job["spec"]["mpiReplicaSpecs"].get("Worker", {}).get("replicas", 0)
    return [f"{job['metadata']['name']}-worker-{i}" for i in range(n)]


def rbac_errors(docs: list) -> list:
    """The launcher's service account and Role against the MPIJob: the launcher's
    serviceAccountName a ServiceAccount of these objects, bound by a RoleBinding to a Role
    whose only rule is get and delete on pods named exactly as the MPIJob's workers (a copy
    with another job name or worker count that kept the old names would delete nothing, or
    another job's pods)."""
    jobs = [d for d in docs if d.get("kind") == "MPIJob"]
    if not jobs:
        return []
    (job,) = jobs
    of = lambda kind: {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}  # noqa: E731
    accounts, roles, bindings = of("ServiceAccount"), of("Role"), of("RoleBinding")
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    sa = launcher.get("serviceAccountName")
    what = f"MPIJob {job['metadata']['name']}"
    if sa is None or sa not in accounts:
        return [
            f"{what}: the launcher's serviceAccountName {sa!r} is not one of the "
            f"ServiceAccounts here ({', '.join(accounts) or 'none'})"
        ]
    bound = [
        b["roleRef"]["name"]
        for b in bindings.values()
        if b["roleRef"]["kind"] == "Role"
        and any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in b.get("subjects", []))
    ]
    if len(bound) != 1 or bound[0] not in roles:
        return [
            f"{what}: ServiceAccount {sa} is bound to {bound or 'no Role'}: one Role of "
            "these objects, by a RoleBinding"
        ]
    role = roles[bound[0]]
    want = {
        "apiGroups": [""],
        "resources": ["pods"],
        "verbs": ["get", "delete"],
        "resourceNames": worker_names(job),
    }
    if role.get("rules") != [want]:
        return [
            f"Role {role['metadata']['name']}: rules are {role.get('rules')}, not get and "
            f"delete on this MPIJob's worker pods {worker_names(job)} (resourceNames)"
        ]
    return []


def check(docs: list) -> list:
    """Every error of a rendered kustomization: the MPIJob against its CRD schema and the
    operator's rules, what the operator makes of it and every other object against the
    Kubernetes API schemas. [] when the API server and the operator would take it all."""
    errs = []
    for d in docs:
        if d.get("kind") == "MPIJob":
            # In the order they act: the API server refuses what its CRD schema refuses; the
            # operator ignores what its validation refuses; then it makes the pods.
            found = crd_errors(d)
            found = found or operator_errors(d)
            if not found:
                made = operator_objects(d)
                for obj in [
                    made["service"],
                    made["configmap"],
                    made["secret"],
                    made["launcher"],
                    *made["workers"],
                ]:
                    found += api_errors(obj)
            errs += found
        else:
            errs += api_errors(d)
    # The launcher's Role against a job the API server and the operator take.
    return errs or rbac_errors(docs)


# --- what a deployment must fill in --------------------------------------------------------------
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
EXAMPLE_REGISTRY = "registry.example.com/"


def deploy_errors(docs: list) -> list:
    """The required edits a rendered kustomization still lacks, one line each: the claim's
    storage class (left out, the cluster's default class decides, usually a single-node one,
    and the claim stays Pending without an error), and images pinned by a real digest."""
    errs = []
    for d in docs:
        what = f"{d.get('kind')} {d.get('metadata', {}).get('name')}"
        if d.get("kind") == "PersistentVolumeClaim":
            cls = d.get("spec", {}).get("storageClassName")
            if not cls or not DNS1123_SUBDOMAIN.match(cls):
                modes = "/".join(d["spec"].get("accessModes", []))
                errs.append(
                    f"{what}: spec.storageClassName is {repr(cls) if cls else 'missing'}"
                    f": name a storage class of your cluster that gives {modes} "
                    "volumes (kubectl get sc)"
                )
        if d.get("kind") == "MPIJob":
            for role, rs in sorted(d["spec"].get("mpiReplicaSpecs", {}).items()):
                for c in rs["template"]["spec"].get("containers", []):
                    image = c.get("image", "")
                    if "@sha256:" not in image:
                        errs.append(
                            f"{what}: {role} image {image} is not pinned by digest "
                            "(images: digest: in the overlay)"
                        )
                    elif image.endswith(PLACEHOLDER_DIGEST) or image.startswith(EXAMPLE_REGISTRY):
                        errs.append(
                            f"{what}: {role} image {image} is the placeholder: your "
                            "registry and the digest docker push printed"
                        )
    return errs


def main(argv) -> int:
    """python tests/k8s_manifests.py DIR...: every kustomization's schema errors and missing
    edits, one line each; exit 1 if there is any."""
    bad = 0
    for directory in argv:
        for line in check(render(directory)) + deploy_errors(render(directory)):
            print(f"{directory}: {line}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
