"""An MPIJob's pods, emulated one by one on this machine, for tests/clusters/test_k8s.py.

What the MPI Operator, the kubelet and the cluster network do for an MPIJob, the parts its
launcher and workers can tell, is done here by hand from the rendered MPIJob:

- **Network** (``Network``): every pod is a network namespace with its own ``eth0`` (a veth
  whose other end is on a bridge in a "switch" namespace of its own: the root namespace's
  network is never touched) and its own address; a new pod gets a new address.
- **A pod** (``Pod``): also its own UTS namespace (host name = the operator's ``hostname``),
  PID namespace (the container's command is PID 1, as in a container: it alone gets the
  SIGTERM of a pod deletion, and when it exits everything else in the pod is killed) and mount
  namespace: the image's file system for what hvdtrain uses of it (an overlay of /etc and
  /root with the Dockerfile's COPYed files, /opt/hvdtrain/.venv from the Dockerfile's build
  stage and the project's files beside it: this checkout and its venv; fresh /run, /tmp and /dev/shm) and the pod's volumes at their
  mount paths: the claim (a directory shared by every pod), the job's key pair laid out as the
  kubelet lays out a Secret volume (``..data`` symlinks, the operator's mode 0600, read-only),
  the hostfile and discover_hosts.sh as a ConfigMap volume (modes 0444 and 0555). Its
  environment is the Dockerfile's ``ENV``, the container's ``env`` and what the operator adds
  (``operator_objects``); its working directory the image's ``WORKDIR``.
- **Cluster DNS**: each pod's /etc/hosts has the kubelet's lines and then what the headless
  Service's DNS would answer it: ``<pod>.<job>.<namespace>.svc[.cluster.local]`` for every
  *ready* pod of the job (the operator's Service has ``publishNotReadyAddresses`` false unless
  ``runLauncherAsWorker``), and the bare pod names where the operator's DNS search path makes
  them resolve (on the workers only). It changes while the job runs: a pod's name appears once
  it is ready and goes when it stops or fails (the file replaced by a rename, every 0.2 s at
  most).
- **The kubelet**: starts the containers, probes the workers' ``readinessProbe`` (exec inside
  the pod, or TCP from the switch namespace, where the "node" is) until it first passes (then
  a pod is ready while its container runs), deletes a pod as Kubernetes does: SIGTERM to PID 1,
  then SIGKILL after ``terminationGracePeriodSeconds`` (or the test's bound), and evicts one
  (``JobRun.evict``): its processes killed, the pod left in phase ``Failed`` (reason
  ``Evicted``), its network gone.
- **The operator**: workers first, the launcher once they are ready
  (``launcherCreationPolicy: WaitForWorkersReady``); a worker that is *missing* (deleted) is
  made again (a new pod, a new address); a Failed one is left as it is.
- **The API server** (``ApiServer``): GET and DELETE of a pod, plain HTTP on the node's address
  (the launcher's ``HVDTRAIN_K8S_API`` names it; a cluster's is https://kubernetes.default.svc),
  each pod's service account token mounted at ``SA_PATH`` as admission mounts it (unless
  ``automountServiceAccountToken: false``), RBAC applied from the Roles and RoleBindings
  applied with the job (a pod name outside a Role's ``resourceNames``: 403). A DELETE of a
  worker makes the operator re-create it.
- **The Job controller**: its back-off before each retry, as a function (``job_backoff``), which
  the tests hold the guide's timing text to; the tests start the next launcher pod themselves
  (``retry_launcher``, ``replace_launcher``) without waiting it.

- **The runtime**: the container's processes as the pod's ``securityContext`` says
  (``runAsUser``, ``runAsGroup``, ``fsGroup``, ``capabilities: drop: [ALL]``,
  ``allowPrivilegeEscalation``), through ``setpriv``: not root, no capability, an empty
  bounding set (no ``CAP_SYS_CHROOT``, as CRI-O's default set lacks it); the image's users
  (its ``useradd``) in the pod's /etc/passwd, their homes in a fresh /home; the host's ssh
  host keys removed where the Dockerfile removes the image's; ``fsGroup`` applied to the
  claim as the kubelet applies it; ``exec`` readiness probes run inside the pod as its user.

The sshd in each worker is Debian's, run by the image's scripts/k8s_worker.sh with the
image's configuration; mpirun, ssh, Python and hvdtrain are this machine's (the same Debian 12
packages the image installs).
Not emulated: the rest of the API server (no TLS, no other resource or verb), the operator's
status and conditions, the Job controller's retries themselves (the test starts the next
launcher), a restart in place (restartPolicy OnFailure), the scheduler, cgroups and resource
limits, a real container runtime and image.

``Network`` has a small surface (create, add_host, on, remove_host, destroy, leftovers) so that
it can later give way to a shared namespace module; ``destroy`` removes every namespace and
process made here and checks, with ``leftovers``, that nothing is left.
"""

from __future__ import annotations

import copy
import ctypes
import http.server
import json
import os
import re
import shlex
import shutil
import signal
import socketserver
import subprocess
import sys
import threading
import time
import uuid

import pytest

from k8s_manifests import ROOT, operator_objects

SUBNET = "10.79.0"  # the switch (the "node") is .1, pods from .10 on
BRIDGE = "br0"
DEBIAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


def sh(*cmd, timeout=30, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


class Network:
    """Network namespaces on one bridge, which lives in a switch namespace of its own."""

    def __init__(self, tag: str):
        self.tag = tag
        self.switch = f"{tag}sw"
        self.hosts = {}  # name -> (namespace, address)
        self.made = []  # namespaces made
        self.inodes = set()  # their net namespace inodes: a process in one is ours
        self.paths = []  # directories the pods' mounts come from (JobRun's): none may stay mounted
        self.next_ip = 10

    def _add_ns(self, ns):
        p = sh("ip", "netns", "add", ns)
        if p.returncode != 0:
            pytest.skip(
                f"cannot make network namespaces here (needs root with CAP_SYS_ADMIN): "
                f"ip netns add: {p.stderr.strip()}"
            )
        self.made.append(ns)
        self.inodes.add(os.stat(f"/run/netns/{ns}").st_ino)

    def create(self):
        for tool in ("ip", "nsenter", "unshare"):
            if shutil.which(tool) is None:
                pytest.fail(f"{tool} missing (iproute2, util-linux)")
        if sh("unshare", "--uts", "--pid", "--fork", "--mount", "true").returncode != 0:
            pytest.skip("cannot make UTS, PID and mount namespaces here (needs CAP_SYS_ADMIN)")
        self._add_ns(self.switch)
        self.check("ip", "-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        self.check("ip", "-n", self.switch, "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        for dev in ("lo", BRIDGE):
            self.check("ip", "-n", self.switch, "link", "set", dev, "up")
        return self

    def add_host(self, name: str) -> str:
        """A new namespace for ``name``, its ``eth0`` on the bridge; its (new) address."""
        ns, ip = f"{self.tag}h{self.next_ip}", f"{SUBNET}.{self.next_ip}"
        port = f"p{self.next_ip}"
        self.next_ip += 1
        self._add_ns(ns)
        self.check(
            "ip",
            "-n",
            self.switch,
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        )
        self.check("ip", "-n", self.switch, "link", "set", port, "master", BRIDGE, "up")
        self.check("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        for dev in ("lo", "eth0"):
            self.check("ip", "-n", ns, "link", "set", dev, "up")
        self.hosts[name] = (ns, ip)
        return ip

    def on(self, host: str, cmd: list) -> list:
        """``cmd`` as run on ``host`` (its network namespace, its host name)."""
        ns = self.switch if host is None else self.hosts[host][0]
        return [
            "nsenter",
            f"--net=/run/netns/{ns}",
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            host or "switch",
            *cmd,
        ]

    def netns(self, host: str) -> str:
        return f"/run/netns/{self.hosts[host][0]}"

    def remove_host(self, name: str):
        ns, _ = self.hosts.pop(name)
        self._kill_in(ns)
        sh("ip", "netns", "del", ns)  # takes its eth0, and the veth's other end, with it

    def _kill_in(self, ns):
        for pid in sh("ip", "netns", "pids", ns).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def check(self, *cmd):
        p = sh(*cmd)
        assert p.returncode == 0, f"{' '.join(cmd)}: {p.stderr}"

    def destroy(self):
        for ns in reversed(self.made):
            self._kill_in(ns)
        for ns in reversed(self.made):
            sh("ip", "netns", "del", ns)
        deadline = time.monotonic() + 10  # SIGKILLed processes take a moment to go
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.leftovers()
        assert not left, f"the emulated cluster left behind: {left}"

    def leftovers(self) -> list:
        """Namespaces of ours still listed, their mounts or the pods' still in this mount
        namespace, and processes still in one of our network namespaces (sshd, mpirun, ranks)."""
        listed = sh("ip", "netns", "list").stdout
        left = [ns for ns in self.made if ns in listed.split()]
        with open("/proc/self/mountinfo") as f:
            left += [
                line.strip()
                for line in f
                if any(ns in line for ns in self.made) or any(str(p) in line for p in self.paths)
            ]
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.stat(f"/proc/{pid}/ns/net").st_ino not in self.inodes:
                    continue
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    args = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            left.append(f"pid {pid}: {args}")
        return left


# --- the image ----------------------------------------------------------------------------------
def dockerfile_lines(dockerfile):
    """The Dockerfile's instructions, one line each: continuations joined, comments and blank
    lines dropped."""
    lines, cont = [], ""
    with open(dockerfile) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not cont and line.lstrip().startswith("#"):
                continue
            if line.endswith("\\"):
                cont += line[:-1] + " "
                continue
            if (cont + line).strip():
                lines.append((cont + line).strip())
            cont = ""
    return lines


class Image:
    """What the Dockerfile's final stage gives a container: ENV, WORKDIR, the COPYed files."""

    def __init__(self, dockerfile=os.path.join(ROOT, "Dockerfile")):
        lines = dockerfile_lines(dockerfile)
        last = max(i for i, l in enumerate(lines) if l.split()[:1] == ["FROM"])
        self.env, self.workdir, self.copies, self.from_build = dict(DEBIAN_ENV), "/", [], []
        self.project = []  # COPY of the checkout's files: (source, destination)
        self.users = {}  # RUN useradd --uid UID NAME: {NAME: UID}
        self.host_keys_removed = False  # RUN rm -f /etc/ssh/ssh_host_*
        for line in lines[last + 1 :]:
            word, _, rest = line.strip().partition(" ")
            if word == "RUN":
                for command in rest.split("&&"):
                    args = shlex.split(command)
                    if args[:1] == ["useradd"]:
                        uid = args[args.index("--uid") + 1] if "--uid" in args else None
                        self.users[args[-1]] = int(uid)
                    if args[:2] == ["rm", "-f"] and any(
                        a.startswith("/etc/ssh/ssh_host_") for a in args
                    ):
                        self.host_keys_removed = True
            if word == "ENV":
                for token in shlex.split(rest):
                    key, _, value = token.partition("=")
                    for k, v in self.env.items():
                        value = value.replace("${%s}" % k, v).replace("$" + k, v)
                    self.env[key] = value
            elif word == "WORKDIR":
                self.workdir = rest.strip()
            elif word == "COPY":
                parts = rest.split()
                if parts[0].startswith("--from="):
                    self.from_build.append((parts[1], parts[2]))
                    continue
                *sources, dst = parts
                for src in sources:
                    if dst.startswith(("/opt/hvdtrain/", "/tmp/")):
                        # The project's files (/opt/hvdtrain/scripts) and sources pip installs
                        # from /tmp: the checkout and its venv stand for them in a pod.
                        self.project.append((src, dst))
                    else:
                        self.copies.append((os.path.join(ROOT, src), dst))


# --- volumes as the kubelet lays them out -------------------------------------------------------
def atomic_volume(directory, files: dict, default_mode: int, dir_mode: int):
    """A Secret or ConfigMap volume's directory: ``..<time>/`` holds the files, ``..data``
    points at it, each file name is a symlink through ``..data`` (the kubelet's AtomicWriter)."""
    os.makedirs(directory)
    stamp = "..2026_01_01_00_00_00.000000001"
    os.mkdir(os.path.join(directory, stamp))
    for name, (content, mode) in files.items():
        path = os.path.join(directory, stamp, name)
        with open(path, "w") as f:
            f.write(content)
        os.chmod(path, default_mode if mode is None else mode)
        os.symlink(os.path.join("..data", name), os.path.join(directory, name))
    os.symlink(stamp, os.path.join(directory, "..data"))
    os.chmod(directory, dir_mode)


# --- pods ---------------------------------------------------------------------------------------
class Pod:
    """One pod's single container, started by ``start`` as PID 1 of its own namespaces."""

    def __init__(
        self,
        net,
        spec: dict,
        name: str,
        base,
        image: Image,
        volumes: dict,
        dns_dir: str,
        venv: str,
        labels=None,
    ):
        self.net, self.spec, self.name, self.dir = net, spec, name, base / name
        self.labels = labels or {}  # the pod's, for the downward API's fieldRef
        self.image, self.volumes, self.dns_dir, self.venv = image, volumes, dns_dir, venv
        self.proc = None
        self.uid = str(uuid.uuid4())  # the API object's: a re-created pod has a new one
        self.dir.mkdir()

    @property
    def container(self):
        return self.spec["containers"][0]

    def _value(self, e: dict) -> str:
        """An env entry's value: ``value``, or the downward API's pod label (a label the pod
        lacks gives "", as the kubelet gives it)."""
        ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if ref is None:
            return e.get("value", "")
        m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", ref)
        if not m:
            raise NotImplementedError(f"env {e['name']}: fieldRef {ref}")
        return self.labels.get(m.group(1), "")

    def _setup(self) -> str:
        d, c = self.dir, self.container
        q = shlex.quote
        lines = ["set -eu", f"hostname {q(self.spec['hostname'])}"]
        for top in ("etc", "root"):  # the image's /etc and /root, writable per container
            for sub in ("up", "work"):
                (d / top / sub).mkdir(parents=True)
            lines.append(
                f"mount -t overlay overlay -o lowerdir=/{top},upperdir={d}/{top}/up,"
                f"workdir={d}/{top}/work /{top}"
            )
        # COPY --from=build /opt/hvdtrain/.venv: the build stage's venv (here, the checkout's
        # venv, where hvdtrain is installed too); the project's files beside it.
        ((src, dst),) = self.image.from_build
        assert (src, dst) == ("/opt/hvdtrain/.venv", "/opt/hvdtrain/.venv"), self.image.from_build
        dst = os.path.dirname(dst)
        lines += ["mount -t tmpfs -o mode=755 tmpfs /opt", f"mkdir {dst}"]
        for entry in sorted(os.listdir(ROOT)):
            if entry not in (".git", ".venv", "runs", ".pytest_cache"):
                lines.append(f"ln -s {q(os.path.join(ROOT, entry))} {dst}/{entry}")
        lines.append(f"ln -s {q(self.venv)} {dst}/.venv")
        # The image's own files: Debian's ssh configuration directories hold only these.
        cleared = set()
        for src, dst in self.image.copies:
            if os.path.dirname(dst) not in cleared:
                cleared.add(os.path.dirname(dst))
                lines.append(f"mkdir -p {q(os.path.dirname(dst))}")
                lines.append(f"rm -f {q(os.path.dirname(dst))}/*")
            lines.append(f"cp {q(src)} {q(dst)}")
        # The cluster DNS: /etc/hosts a link into the JobRun's directory for this pod, whose
        # file it replaces (rename) as pods become ready or go: a name resolves only while the
        # headless Service publishes the pod's address.
        lines += [
            "mkdir /etc/.cluster-dns",
            f"mount --bind {q(self.dns_dir)} /etc/.cluster-dns",
            "mount -o remount,bind,ro /etc/.cluster-dns",
            "rm -f /etc/hosts",
            "ln -s .cluster-dns/hosts /etc/hosts",
        ]
        if self.image.host_keys_removed:  # the host's keys are not the image's
            lines.append("rm -f /etc/ssh/ssh_host_*")
        # The image's users (useradd): theirs alone are their uids (not the host's), their
        # homes in the image's /home; and /root traversable as in a Debian image (the
        # venv's interpreter may live under the host's /root).
        lines += ["mount -t tmpfs -o mode=755 tmpfs /home", "chmod 755 /root"]
        for user, uid in self.image.users.items():
            lines += [
                f"sed -i '/^[^:]*:[^:]*:{uid}:/d' /etc/passwd",
                f"sed -i '/^[^:]*:[^:]*:{uid}:/d' /etc/group",
                f"echo '{user}:x:{uid}:{uid}::/home/{user}:/bin/bash' >>/etc/passwd",
                f"echo '{user}:x:{uid}:' >>/etc/group",
                f"echo '{user}:*:20000:0:99999:7:::' >>/etc/shadow",
                f"mkdir -p /home/{user}",
                f"chown {uid}:{uid} /home/{user}",
            ]
        mounts = c.get("volumeMounts", [])
        mounted = {m["mountPath"] for m in mounts}
        privates = [p for p in ("/run", "/dev/shm", "/tmp") if p not in mounted]
        under_private = lambda path: any(  # noqa: E731  (/var/run is /run)
            re.sub(r"^/var/run/", "/run/", path).startswith(p + "/") for p in privates
        )
        later = []  # mounts inside a private directory: bound after it is made (the
        #             service account's /var/run/secrets/...)
        for i, m in enumerate(mounts):
            source, read_only = self.volumes[m["name"]]
            target = m["mountPath"]
            if under_private(target):
                later.append((f"/opt/.vol{i}", target, read_only or m.get("readOnly")))
                target = f"/opt/.vol{i}"
            lines.append(f"mkdir -p {q(target)}")
            if source is None:  # emptyDir
                lines.append(f"mount -t tmpfs tmpfs {q(target)}")
            else:
                lines.append(f"mount --bind {q(str(source))} {q(target)}")
                if (read_only or m.get("readOnly")) and not under_private(m["mountPath"]):
                    lines.append(f"mount -o remount,bind,ro {q(target)}")
        # The checkout and its venv stay at their own paths too (the symlinks above, the
        # venv's scripts and its editable install name them): kept aside while /tmp and the
        # others are made private, then put back, so a checkout under /tmp (a CI clone) works.
        keep = sorted(
            {
                os.path.realpath(p)
                for p in (ROOT, self.venv)
                if any(os.path.realpath(p).startswith(v + "/") for v in privates)
            }
        )
        for i, path in enumerate(keep):
            lines += [f"mkdir -p /opt/.keep{i}", f"mount --bind {q(path)} /opt/.keep{i}"]
        for private in privates:  # last: the sources above are in /tmp
            lines.append(f"mount -t tmpfs -o mode=1777 tmpfs {private}")
        for i, path in enumerate(keep):
            lines += [f"mkdir -p {q(path)}", f"mount --bind /opt/.keep{i} {q(path)}"]
        for staged, target, read_only in later:
            lines += [f"mkdir -p {q(target)}", f"mount --bind {staged} {q(target)}"]
            if read_only:
                lines.append(f"mount -o remount,bind,ro {q(target)}")
        env = dict(self.image.env, HOSTNAME=self.spec["hostname"], HOME=self.home())
        for e in c.get("env", []):
            env[e["name"]] = self._value(e)
        self.exec_prefix = self.user_prefix() + ["env", "-i"] + [f"{k}={v}" for k, v in env.items()]
        lines.append(f"cd {q(c.get('workingDir', self.image.workdir))}")
        lines.append("exec " + " ".join(map(q, self.exec_prefix)) + ' "$@"')
        script = d / "setup.sh"
        script.write_text("\n".join(lines) + "\n")
        return str(script)

    def security(self) -> dict:
        """The container's securityContext over the pod's (the container's fields win)."""
        return {**self.spec.get("securityContext", {}), **self.container.get("securityContext", {})}

    def home(self) -> str:
        uid = self.security().get("runAsUser", 0)
        names = [n for n, u in self.image.users.items() if u == uid]
        return f"/home/{names[0]}" if names else "/root"

    def user_prefix(self) -> list:
        """How the runtime starts the container's processes: as runAsUser (runAsGroup, and
        fsGroup as a supplementary group) and, with capabilities drop [ALL] or as a user
        other than root, with no capability at all, none to regain (the bounding set
        emptied: no CAP_SYS_CHROOT, as under CRI-O's defaults and less);
        allowPrivilegeEscalation false: no_new_privs. [] for root with every capability
        (the emulation's own)."""
        sec = self.security()
        uid = sec.get("runAsUser", 0)
        if uid == 0 and "ALL" not in sec.get("capabilities", {}).get("drop", []):
            return []
        prefix = ["setpriv", f"--reuid={uid}", f"--regid={sec.get('runAsGroup', uid)}"]
        prefix.append(f"--groups={sec['fsGroup']}" if "fsGroup" in sec else "--clear-groups")
        prefix += ["--inh-caps=-all", "--bounding-set=-all"]
        if sec.get("allowPrivilegeEscalation") is False:
            prefix.append("--no-new-privs")
        return prefix

    def start(self):
        """The container: its command and args as PID 1, stdout and stderr to the pod's log."""
        cmd = self.container.get("command", []) + self.container.get("args", [])
        script = self._setup()
        with open(self.dir / "log", "w") as log:
            self.proc = subprocess.Popen(
                [
                    "nsenter",
                    f"--net={self.net.netns(self.name)}",
                    "unshare",
                    "--uts",
                    "--mount",
                    "--pid",
                    "--fork",
                    "--kill-child",
                    "--mount-proc",
                    "sh",
                    script,
                    *cmd,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def pid1(self):
        """The host's pid of the container's PID 1 (unshare's child), or None."""
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                children = f.read().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def log(self) -> str:
        return (self.dir / "log").read_text(errors="replace")

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def sigterm(self):
        """What a pod deletion sends: SIGTERM to the container's PID 1 only."""
        pid = self.pid1()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # unshare: --kill-child takes PID 1
            self.proc.wait(timeout=10)

    def ready(self) -> bool:
        """The container's readinessProbe (exec in the container, as its user; tcpSocket
        from the node); no probe: running."""
        if self.proc.poll() is not None:
            return False
        probe = self.container.get("readinessProbe")
        if not probe:
            return self.pid1() is not None
        if "exec" in probe:
            pid = self.pid1()
            if pid is None:
                return False
            p = sh(
                "nsenter",
                "-t",
                str(pid),
                "--net",
                "--uts",
                "--mount",
                "--pid",
                "--wd=/",
                *self.exec_prefix,
                *probe["exec"]["command"],
                timeout=probe.get("timeoutSeconds", 1) + 5,
            )
            return p.returncode == 0
        port = probe["tcpSocket"]["port"]
        ip = self.net.hosts[self.name][1]
        p = sh(*self.net.on(None, ["bash", "-c", f"exec 3<>/dev/tcp/{ip}/{port}"]), timeout=10)
        return p.returncode == 0


class JobRun:
    """One set of pods for an MPIJob: what the operator and the kubelets start for it."""

    def __init__(
        self,
        net,
        base,
        job: dict,
        claims: dict,
        namespace="default",
        venv=sys.prefix,
        job_uid=None,
        rbac=(),
    ):
        self.net, self.base, self.job, self.claims = net, base, job, claims
        # The launcher Job's UID: a retry (the Job's next pod) passes the first run's.
        self.job_uid = job_uid or str(uuid.uuid4())
        self.replaced = []  # launcher pods that the next one replaced (logs kept)
        self.namespace, self.venv = namespace, venv
        self.rbac = list(rbac)  # the ServiceAccounts, Roles and RoleBindings applied with it
        self.objects = operator_objects(job, namespace)
        self.image = Image()
        self.pods = {}
        self.lock = threading.RLock()
        self.ready = set()  # pods whose address the headless Service publishes
        self.failed = {}  # pods left in phase Failed: {name: (reason, message)}
        self.gone = []  # pods deleted through the API (logs kept)
        self.recreate = []  # deleted workers the operator is to make again
        self.created = 0
        self.api = None
        self._stop, self._thread = threading.Event(), None
        base.mkdir(parents=True)
        net.paths.append(base)

    @property
    def launcher(self) -> Pod:
        return self.pods[self.objects["launcher"]["spec"]["template"]["spec"]["hostname"]]

    @property
    def workers(self) -> list:
        return [self.pods[w["metadata"]["name"]] for w in self.objects["workers"]]

    def _keys(self):
        """The operator's key pair: ECDSA P-521, the private key in PEM ("EC PRIVATE KEY"), the
        public one in authorized_keys format without a comment (newSSHAuthSecret)."""
        key = self.base / "key"
        p = sh(
            "ssh-keygen",
            "-q",
            "-t",
            "ecdsa",
            "-b",
            "521",
            "-m",
            "PEM",
            "-N",
            "",
            "-C",
            "",
            "-f",
            str(key),
        )
        assert p.returncode == 0, p.stderr
        public = " ".join(key.with_suffix(".pub").read_text().split()[:2]) + "\n"
        return {"ssh-privatekey": key.read_text(), "ssh-publickey": public}

    def _volumes(self, pod_name, spec, root=None):
        made = self.objects
        out = {}
        for v in spec.get("volumes", []):
            where = (root or self.base) / "volumes" / pod_name / v["name"]
            if "persistentVolumeClaim" in v:
                claim = self.claims[v["persistentVolumeClaim"]["claimName"]]
                group = spec.get("securityContext", {}).get("fsGroup")
                if group is not None:  # the kubelet's volume ownership for fsGroup
                    for d, dirs, files in os.walk(claim):
                        for path in [d] + [os.path.join(d, f) for f in files]:
                            os.chown(path, -1, group)
                            mode = os.stat(path).st_mode
                            os.chmod(path, mode | 0o060 | (0o2010 if path == d else 0))
                out[v["name"]] = (claim, False)
            elif "emptyDir" in v:
                out[v["name"]] = (None, False)
            elif "secret" in v:
                data = self.secret
                mode = v["secret"].get("defaultMode", 0o644)
                files = {i["path"]: (data[i["key"]], i.get("mode")) for i in v["secret"]["items"]}
                atomic_volume(where, files, mode, 0o1777)
                out[v["name"]] = (where, True)
            elif "projected" in v:  # the service account's token (_admit)
                files = {
                    "token": (self.api.token(v["projected"]["serviceAccountName"]), None),
                    "ca.crt": ("(the cluster's CA: unused over the emulation's HTTP)\n", None),
                    "namespace": (self.namespace, None),
                }
                atomic_volume(where, files, 0o644, 0o1777)
                out[v["name"]] = (where, True)
            elif "configMap" in v:
                data = made["configmap"]["data"]
                files = {
                    i["path"]: (data[i["key"]], i.get("mode")) for i in v["configMap"]["items"]
                }
                atomic_volume(where, files, v["configMap"].get("defaultMode", 0o644), 0o777)
                out[v["name"]] = (where, True)
            else:
                raise NotImplementedError(f"volume {v}")
        return out

    def _dns_dir(self, pod_name, root=None) -> str:
        """The directory whose ``hosts`` file is this pod's /etc/hosts (``_publish`` writes it)."""
        path = (root or self.base) / "dns" / pod_name
        path.mkdir(parents=True)
        os.chmod(path, 0o755)
        return str(path)

    def _hosts(self, pod: Pod) -> str:
        """The kubelet's /etc/hosts lines, then the cluster DNS's answers for this pod: the
        headless Service publishes only ready pods (the operator's publishNotReadyAddresses is
        false unless runLauncherAsWorker)."""
        job, ns = self.job["metadata"]["name"], self.namespace
        fqdn = lambda n: f"{n}.{job}.{ns}.svc.cluster.local"  # noqa: E731
        own = self.net.hosts[pod.name][1]
        lines = [
            "# Kubernetes-managed hosts file (emulated).",
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            f"{own}\t{fqdn(pod.spec['hostname'])}\t{pod.spec['hostname']}",
            "# The cluster DNS's answers (headless Service %s):" % job,
        ]
        searches = pod.spec.get("dnsConfig", {}).get("searches", [])
        publish_all = self.objects["service"]["spec"]["publishNotReadyAddresses"]
        for other in sorted(self.pods):
            if (
                other == pod.name
                or other not in self.net.hosts
                or not (other in self.ready or (publish_all and other not in self.failed))
            ):
                continue
            # "<pod>.<job>.<namespace>.svc" resolves through the search domain cluster.local.
            names = [fqdn(other), f"{other}.{job}.{ns}.svc"]
            if f"{job}.{ns}.svc.cluster.local" in searches:
                names.append(other)
            lines.append(f"{self.net.hosts[other][1]}\t" + "\t".join(names))
        return "\n".join(lines) + "\n"

    def _publish(self):
        """Every pod's /etc/hosts rewritten (a new file renamed over the old: a reader sees
        one or the other) from the pods ready now."""
        with self.lock:
            for pod in self.pods.values():
                if pod.name not in self.net.hosts:
                    continue
                tmp = os.path.join(pod.dns_dir, ".hosts.new")
                with open(tmp, "w") as f:
                    f.write(self._hosts(pod))
                os.chmod(tmp, 0o644)
                os.rename(tmp, os.path.join(pod.dns_dir, "hosts"))

    def _admit(self, spec: dict) -> dict:
        """The pod spec as the API server's admission leaves it: the service account's token,
        ca.crt and namespace mounted at SA_PATH (unless automountServiceAccountToken is false
        in the pod or its ServiceAccount); a named ServiceAccount must exist. And the API
        server's URL in HVDTRAIN_K8S_API (in a cluster: https://kubernetes.default.svc)."""
        spec = copy.deepcopy(spec)
        sa = spec.get("serviceAccountName", "default")
        accounts = {d["metadata"]["name"]: d for d in self.rbac if d["kind"] == "ServiceAccount"}
        if sa != "default" and sa not in accounts:
            pytest.fail(f"pod refused: serviceaccount {sa!r} not found")
        automount = spec.get(
            "automountServiceAccountToken",
            accounts.get(sa, {}).get("automountServiceAccountToken", True),
        )
        c = spec["containers"][0]
        if automount:
            spec.setdefault("volumes", []).append(
                {"name": "kube-api-access", "projected": {"serviceAccountName": sa}}
            )
            c.setdefault("volumeMounts", []).append(
                {"name": "kube-api-access", "mountPath": SA_PATH, "readOnly": True}
            )
        c.setdefault("env", []).append({"name": "HVDTRAIN_K8S_API", "value": self.api.url})
        return spec

    def start(self, ready_timeout=30, before_launcher=None):
        """Workers, then (once every one is ready) the launcher; ``before_launcher()`` runs
        between (a test's change to the workers that a retried launcher pod finds)."""
        self.secret = self._keys()
        self.api = ApiServer(self.namespace, self.rbac, self, self.net).start()
        labels = {w["spec"]["hostname"]: w["metadata"]["labels"] for w in self.objects["workers"]}
        for w in self.objects["workers"]:
            name = w["metadata"]["name"]
            self.net.add_host(name)
            spec = self._admit(w["spec"])
            self.pods[name] = Pod(
                self.net,
                spec,
                name,
                self.base,
                self.image,
                self._volumes(name, spec),
                self._dns_dir(name),
                self.venv,
                labels.get(name),
            )
        self._publish()
        for w in self.workers:
            w.start()
        self._thread = threading.Thread(target=self._control, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + ready_timeout
        while not all(w.name in self.ready for w in self.workers):
            dead = [w for w in self.workers if w.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.fail(
                    "workers not ready:\n"
                    + "\n".join(
                        f"--- {w.name} (rc {w.proc.poll()})\n{w.log()}" for w in self.workers
                    )
                )
            time.sleep(0.1)
        if before_launcher is not None:
            before_launcher()
        self._start_launcher()
        return self

    def _start_launcher(self, root=None) -> Pod:
        """A launcher pod (the Job's first, or its next: ``root`` for its files), new address."""
        name = self.objects["launcher"]["spec"]["template"]["spec"]["hostname"]
        spec = self._admit(self.objects["launcher"]["spec"]["template"]["spec"])
        self.net.add_host(name)
        pod = Pod(
            self.net,
            spec,
            name,
            root or self.base,
            self.image,
            self._volumes(name, spec, root),
            self._dns_dir(name, root),
            self.venv,
            self._launcher_labels(),
        )
        with self.lock:
            self.pods[name] = pod
            self._publish()
        return pod.start()

    def _launcher_labels(self) -> dict:
        """The launcher pod's: its template's, and the Job controller's (Kubernetes 1.27+)."""
        launcher = self.objects["launcher"]
        return {
            **launcher["spec"]["template"]["metadata"]["labels"],
            "batch.kubernetes.io/controller-uid": self.job_uid,
            "batch.kubernetes.io/job-name": launcher["metadata"]["name"],
            "controller-uid": self.job_uid,
            "job-name": launcher["metadata"]["name"],
        }

    # --- the kubelets, the endpoints and the operator, while the job runs -------------------
    def _control(self):
        """Every 0.2 s: workers deleted through the API re-created (the operator), each pod's
        readiness (its probe until it first passes, then: still running), and the DNS
        answers when that changed."""
        while not self._stop.wait(0.2):
            with self.lock:
                for name in self.recreate:
                    self._create_worker(name)
                self.recreate.clear()
                pods = dict(self.pods)
            changed = False
            for name, pod in pods.items():
                alive = pod.proc is not None and pod.proc.poll() is None
                ok = alive and name not in self.failed and (name in self.ready or pod.ready())
                with self.lock:
                    if self.pods.get(name) is pod and ok != (name in self.ready):
                        (self.ready.add if ok else self.ready.discard)(name)
                        changed = True
            if changed and not self._stop.is_set():
                self._publish()

    def _create_worker(self, name):
        """The operator's newWorker for a missing worker: a new pod, a new address."""
        (w,) = [w for w in self.objects["workers"] if w["metadata"]["name"] == name]
        self.created += 1
        root = self.base / f"recreated{self.created}"
        root.mkdir()
        spec = self._admit(w["spec"])
        self.net.add_host(name)
        pod = Pod(
            self.net,
            spec,
            name,
            root,
            self.image,
            self._volumes(name, spec, root),
            self._dns_dir(name, root),
            self.venv,
            w["metadata"]["labels"],
        )
        self.pods[name] = pod
        self._publish()
        pod.start()

    def evict(
        self,
        name,
        reason="Evicted",
        message="The node was low on resource: ephemeral-storage. Threshold quantity: "
        "10%, available: 4%.",
    ):
        """The kubelet's eviction of a worker: its processes killed (no SIGTERM: a hard
        eviction), its network gone, the pod left in phase Failed with that reason and
        message; its name out of the DNS. The operator does not re-create it (it is not
        missing); deleting it (the API) does."""
        pod = self.pods[name]
        pod.kill()
        ns = self.net.hosts[name][0]
        deadline = time.monotonic() + 10  # every process gone (its sockets closed) first
        while sh("ip", "netns", "pids", ns).stdout.split() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.lock:
            self.failed[name] = (reason, message)
            self.ready.discard(name)
            self.net.remove_host(name)
            self._publish()

    # --- what the API server answers (ApiServer) -----------------------------------------------
    def pod_json(self, name):
        """The pod as GET returns it (the fields the launcher reads), or None."""
        with self.lock:
            pod = self.pods.get(name)
            if pod is None:
                return None
            if name in self.failed:
                reason, message = self.failed[name]
                status = {"phase": "Failed", "reason": reason, "message": message}
            elif pod.proc is None:
                status = {"phase": "Pending"}
            else:  # an exit in place is not emulated (the kubelet restarts it: OnFailure)
                rc = pod.proc.poll()
                status = {"phase": "Succeeded" if rc == 0 else "Running"}
                if name in self.net.hosts:
                    status["podIP"] = self.net.hosts[name][1]
            return {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "uid": pod.uid,
                    "labels": pod.labels,
                },
                "status": status,
            }

    def delete_pod(self, name, uid=None):
        """DELETE: (HTTP status, the pod). A Failed pod goes at once; a running one gets the
        SIGTERM, then SIGKILL after its grace; a deleted worker is re-created (``_control``)."""
        with self.lock:
            pod, body = self.pods.get(name), self.pod_json(name)
            if pod is None:
                return 404, None
            if uid is not None and uid != pod.uid:
                return 409, None
            is_worker = any(w["metadata"]["name"] == name for w in self.objects["workers"])
            if name in self.failed:
                del self.failed[name]
                self.pods.pop(name)
                self.gone.append(pod)
                if is_worker:
                    self.recreate.append(name)
                return 200, body
        grace = min(pod.spec.get("terminationGracePeriodSeconds", 30), 60)

        def stop():
            pod.sigterm()
            pod.wait(grace)
            pod.kill()
            with self.lock:
                if self.pods.get(name) is pod:
                    self.pods.pop(name)
                    self.ready.discard(name)
                    self.gone.append(pod)
                    if name in self.net.hosts:
                        self.net.remove_host(name)
                    if is_worker and not self._stop.is_set():
                        self.recreate.append(name)

        threading.Thread(target=stop, daemon=True).start()
        return 200, body

    # --- the test's part ------------------------------------------------------------------------
    def replace_launcher(self):
        """The launcher's node gone at once, then the Job's next launcher pod. The old pod's
        network is cut before its processes die, so that the workers see no connection close
        (as from a dead node: their daemons and ranks go on for minutes); the new pod has a
        new address, the same workers. Returns the old pod (its log stays readable)."""
        old = self.launcher
        ns, _ = self.net.hosts[old.name]
        self.net.check("ip", "-n", ns, "link", "set", "eth0", "down")
        old.kill()
        return self._next_launcher(old)

    def retry_launcher(self):
        """The Job's next launcher pod after the last one failed (its container ended: the
        test waits for that). The Job controller's back-off (``job_backoff``) is not waited
        here. Returns the old pod (its log stays readable)."""
        old = self.launcher
        assert old.proc.poll() is not None, "the launcher still runs"
        return self._next_launcher(old)

    def _next_launcher(self, old):
        with self.lock:
            self.ready.discard(old.name)
            self.net.remove_host(old.name)
            self.replaced.append(old)
        root = self.base / f"retry{len(self.replaced)}"
        root.mkdir()
        self._start_launcher(root)
        return old

    def logs(self) -> str:
        with self.lock:
            pods = list(self.pods.items())
        return "\n".join(
            [f"--- {p.name} (deleted)\n{p.log()}" for p in self.gone]
            + [f"--- {name}\n{p.log()}" for name, p in pods]
        )

    def _stop_control(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def delete(self, grace: float) -> dict:
        """Delete every pod as Kubernetes does: SIGTERM to each PID 1 at once, SIGKILL what is
        left after ``grace`` s. {pod: its container's exit status (None: killed)}."""
        self._stop_control()
        for p in self.pods.values():
            p.sigterm()
        deadline = time.monotonic() + grace
        statuses = {}
        for name, p in self.pods.items():
            statuses[name] = p.wait(max(0.0, deadline - time.monotonic()))
        self.remove()
        return statuses

    def remove(self):
        """Kill whatever is left, remove the pods' namespaces, stop the API server."""
        self._stop_control()
        with self.lock:
            for p in list(self.pods.values()) + self.gone + self.replaced:
                if p.proc is not None:
                    p.kill()
                if p.name in self.net.hosts and self.pods.get(p.name) is p:
                    self.net.remove_host(p.name)
        if self.api is not None:
            self.api.close()


# --- the API server -----------------------------------------------------------------------------
SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
CLONE_NEWNET = 0x40000000


def in_netns(path, fn):
    """``fn()`` run in a thread that has joined the network namespace at ``path`` (a socket
    made there stays there)."""
    out = {}

    def run():
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {path}")
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (raised again in the caller)
            out["error"] = e
        finally:
            os.close(fd)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class ApiServer:
    """The part of the Kubernetes API server that k8s_launcher.sh (scripts/k8s_pods.py) uses:
    GET and DELETE of /api/v1/namespaces/NS/pods/NAME, over plain HTTP on the emulated node's
    address (the switch namespace's bridge, which every pod reaches; 127.0.0.1 with no
    ``net``), a service account's bearer token (``token``: what its pods' token file holds)
    authenticated, and RBAC applied from the Roles and RoleBindings given: a request is
    allowed only by a rule of a Role bound to that service account whose apiGroups, resources,
    verbs and resourceNames (if any) take it; else 403, with the API server's message.
    ``pods`` answers: ``pod_json(name)``, ``delete_pod(name, uid)`` (JobRun).
    ``requests``: (method, pod, service account, status) of each request, in order; ``times``:
    when each came (time.monotonic())."""

    def __init__(self, namespace, rbac, pods, net=None):
        self.namespace, self.rbac, self.pods, self.net = namespace, list(rbac), pods, net
        self.tokens = {}  # token -> service account
        self.requests, self.times = [], []  # and when each came
        self.server = None

    def token(self, account: str) -> str:
        for t, a in self.tokens.items():
            if a == account:
                return t
        t = f"emulated.{account}.{uuid.uuid4().hex}"
        self.tokens[t] = account
        return t

    def allowed(self, account, verb, name) -> bool:
        roles = {d["metadata"]["name"]: d for d in self.rbac if d["kind"] == "Role"}
        for b in self.rbac:
            if b["kind"] != "RoleBinding" or b["roleRef"]["kind"] != "Role":
                continue
            if not any(
                s.get("kind") == "ServiceAccount"
                and s.get("name") == account
                and s.get("namespace", self.namespace) == self.namespace
                for s in b.get("subjects", [])
            ):
                continue
            for rule in roles.get(b["roleRef"]["name"], {}).get("rules", []):
                if (
                    "" in rule.get("apiGroups", [])
                    and "pods" in rule.get("resources", [])
                    and (verb in rule.get("verbs", []) or "*" in rule.get("verbs", []))
                    and (not rule.get("resourceNames") or name in rule["resourceNames"])
                ):
                    return True
        return False

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self):
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code, reason, message):
                self._answer(
                    code,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "message": message,
                        "reason": reason,
                        "code": code,
                    },
                )

            def _handle(self, verb):
                m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/?]+)(\?.*)?", self.path)
                auth = self.headers.get("Authorization", "")
                account = (
                    api.tokens.get(auth[len("Bearer ") :]) if auth.startswith("Bearer ") else None
                )
                name = m.group(2) if m else None
                if account is None:
                    code = 401
                    self._status(401, "Unauthorized", "Unauthorized")
                elif m is None:
                    code = 404
                    self._status(
                        404, "NotFound", "the server could not find the requested resource"
                    )
                elif m.group(1) != api.namespace or not api.allowed(account, verb, name):
                    code = 403
                    self._status(
                        403,
                        "Forbidden",
                        (
                            f'pods "{name}" is forbidden: User "system:serviceaccount:'
                            f'{api.namespace}:{account}" cannot {verb} resource "pods" in API '
                            f'group "" in the namespace "{m.group(1)}"'
                        ),
                    )
                elif verb == "get":
                    pod = api.pods.pod_json(name)
                    code = 200 if pod else 404
                    if pod:
                        self._answer(200, pod)
                    else:
                        self._status(404, "NotFound", f'pods "{name}" not found')
                else:
                    length = int(self.headers.get("Content-Length") or 0)
                    options = json.loads(self.rfile.read(length) or b"{}")
                    uid = (options.get("preconditions") or {}).get("uid")
                    code, pod = api.pods.delete_pod(name, uid)
                    if code == 200:
                        self._answer(200, pod)
                    elif code == 409:
                        self._status(
                            409,
                            "Conflict",
                            f"Operation cannot be fulfilled on pods "
                            f'"{name}": Precondition failed: UID in precondition: {uid}',
                        )
                    else:
                        self._status(404, "NotFound", f'pods "{name}" not found')
                api.requests.append((verb.upper(), name, account, code))
                api.times.append(time.monotonic())

            def do_GET(self):
                self._handle("get")

            def do_DELETE(self):
                self._handle("delete")

        def bind():
            server = http.server.ThreadingHTTPServer(
                (f"{SUBNET}.1" if self.net else "127.0.0.1", 0), Handler, bind_and_activate=False
            )
            server.daemon_threads = True
            socketserver.TCPServer.server_bind(server)  # not HTTPServer's: no name look-up
            server.server_name, server.server_port = "emulated", server.server_address[1]
            server.server_activate()
            return server

        self.server = in_netns(f"/run/netns/{self.net.switch}", bind) if self.net else bind()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def close(self):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


# --- the Job controller -------------------------------------------------------------------------
BACKOFF_FIRST, BACKOFF_MAX = 10, 360  # DefaultJobPodFailureBackOff, MaxJobPodFailureBackOff


def job_backoff(retry: int) -> int:
    """Seconds the Job controller waits before its ``retry``-th new pod (1: after the first
    failed pod): 10 s, doubling, at most 6 min (Kubernetes' pkg/controller/job). Not waited in
    the emulation: the tests start the next launcher pod themselves."""
    return min(BACKOFF_FIRST * 2 ** (retry - 1), BACKOFF_MAX)
