#!/usr/bin/env python3
"""A worker pod of an hvdtrain MPIJob that Kubernetes left Failed, deleted through the API
server so that the MPI Operator re-creates it. Run by scripts/k8s_launcher.sh in the launcher
pod, while it waits for a worker that does not answer ssh:

    k8s_pods.py replace-failed HOST     HOST: the hostfile's name, <pod>.<job>.<namespace>.svc

The operator re-creates only worker pods that are missing. A worker the kubelet evicted (node
pressure, its ephemeral-storage limit) or stopped in a graceful node shutdown stays in phase
Failed, its name out of the cluster DNS, and nothing replaces it. This asks the API server for
the pod and, if it is Failed, deletes it (with its UID as precondition: that pod, not a newer
one of the same name). It needs the launcher's service account and the Role of
deploy/kubernetes/base (get and delete on the job's worker pods, by name).

In the pod: the API server at https://kubernetes.default.svc (HVDTRAIN_K8S_API overrides it;
an http:// URL is taken too), the service account's token, ca.crt and namespace in
/var/run/secrets/kubernetes.io/serviceaccount (HVDTRAIN_K8S_SA_DIR). Python's standard library
only: the image has no kubectl.

Prints at most one line (what it did, or why it could not) and exits 0 (nothing to do: the
pod runs, is pending, or is gone and being re-created), 10 (deleted a Failed pod), 3 (no
service account token: nothing can be done from here), 5 (403: the launcher's account lacks
the Role, which asking again does not change), 4 (the API server refused or failed).
"""
import json
import os
import ssl
import sys
import urllib.error
import urllib.request

SA_DIR = os.environ.get("HVDTRAIN_K8S_SA_DIR", "/var/run/secrets/kubernetes.io/serviceaccount")
API = os.environ.get("HVDTRAIN_K8S_API", "https://kubernetes.default.svc").rstrip("/")
TIMEOUT = 10

NOTHING, DELETED, NO_TOKEN, API_ERROR, FORBIDDEN = 0, 10, 3, 4, 5


def _read(name):
    try:
        with open(os.path.join(SA_DIR, name)) as f:
            return f.read().strip()
    except OSError:
        return None


def _call(method, url, token, body=None):
    """(HTTP status, parsed JSON body or {}) of one request; URLError and OSError raised."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Accept": "application/json",
        **({"Content-Type": "application/json"} if data else {})})
    context = None
    if url.startswith("https:"):
        ca = os.path.join(SA_DIR, "ca.crt")
        context = ssl.create_default_context(cafile=ca if os.path.exists(ca) else None)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT, context=context) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"message": raw.decode(errors="replace")[:200]}


def replace_failed(host: str) -> int:
    pod, _, rest = host.partition(".")
    labels = rest.split(".")
    namespace = _read("namespace") or (labels[1] if len(labels) > 1 else "default")
    by_hand = f"kubectl delete pod {pod} -n {namespace}"
    token = _read("token")
    if not token:
        print(f"{pod} does not answer ssh, and this launcher has no service account token "
              f"({SA_DIR}/token): a worker that Kubernetes left Failed (evicted) is not "
              f"replaced from here; if kubectl get pod {pod} -n {namespace} says Failed or "
              f"Evicted, delete it: {by_hand}")
        return NO_TOKEN
    url = f"{API}/api/v1/namespaces/{namespace}/pods/{pod}"

    def refused(verb, status, body):
        why = " ".join(str(body.get("message") or body.get("reason") or "").split())
        if status == 403:
            print(f"cannot {verb} worker pod {pod} through the API server (403: {why}): the "
                  f"launcher lacks '{verb}' on pods/{pod} (its Role, deploy/kubernetes/base, "
                  f"is not applied or not bound); a Failed worker is left to you: {by_hand}")
            return FORBIDDEN
        else:
            print(f"cannot {verb} worker pod {pod} through the API server {API} (HTTP "
                  f"{status}: {why}); a Failed worker is left to you: {by_hand}")
        return API_ERROR

    try:
        status, body = _call("GET", url, token)
        if status == 404:
            return NOTHING  # deleted: the operator is re-creating it
        if status != 200:
            return refused("get", status, body)
        st = body.get("status") or {}
        if st.get("phase") != "Failed":
            return NOTHING
        uid = (body.get("metadata") or {}).get("uid")
        status, answer = _call("DELETE", url, token, {
            "kind": "DeleteOptions", "apiVersion": "v1",
            **({"preconditions": {"uid": uid}} if uid else {})})
        if status in (404, 409):  # gone, or already a new pod of that name
            return NOTHING
        if status not in (200, 202):
            return refused("delete", status, answer)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        print(f"cannot reach the API server {API} ({reason}); a Failed worker is left to you: "
              f"{by_hand}")
        return API_ERROR
    what = " ".join(": ".join(str(x) for x in (st.get("reason"), st.get("message")) if x).split())
    what = what or "no reason given"
    print(f"worker pod {pod} is Failed ({what}): deleted it, the operator re-creates it")
    return DELETED


def main(argv) -> int:
    if len(argv) != 2 or argv[0] != "replace-failed":
        print("usage: k8s_pods.py replace-failed HOST", file=sys.stderr)
        return 2
    return replace_failed(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
