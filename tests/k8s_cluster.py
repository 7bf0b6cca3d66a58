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
  Service's DNS would answer it: ``<pod>.<job>.<namespace>.svc[.cluster.local]`` for every pod
  of the job, and the bare pod names where the operator's DNS search path makes them resolve
  (on the workers only).
- **The kubelet**: starts the containers, probes the workers' ``readinessProbe`` (TCP, from
  the switch namespace, where the "node" is), and deletes a pod as Kubernetes does: SIGTERM to
  PID 1, then SIGKILL after ``terminationGracePeriodSeconds`` (or the test's bound).
- **The operator**: workers first, the launcher once they are ready
  (``launcherCreationPolicy: WaitForWorkersReady``).

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
Not emulated: the API server, the operator's controller loop and the Job controller's retries
(the test starts the next launcher itself), the scheduler, cgroups and resource limits, DNS
changes while a pod runs, a real container runtime and image.

``Network`` has a small surface (create, add_host, on, remove_host, destroy, leftovers) so that
it can later give way to a shared namespace module; ``destroy`` removes every namespace and
process made here and checks, with ``leftovers``, that nothing is left.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
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
        self.hosts = {}   # name -> (namespace, address)
        self.made = []    # namespaces made
        self.inodes = set()  # their net namespace inodes: a process in one is ours
        self.paths = []   # directories the pods' mounts come from (JobRun's): none may stay mounted
        self.next_ip = 10

    def _add_ns(self, ns):
        p = sh("ip", "netns", "add", ns)
        if p.returncode != 0:
            pytest.skip(f"cannot make network namespaces here (needs root with CAP_SYS_ADMIN): "
                        f"ip netns add: {p.stderr.strip()}")
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
        self.check("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name",
                   "eth0", "netns", ns)
        self.check("ip", "-n", self.switch, "link", "set", port, "master", BRIDGE, "up")
        self.check("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        for dev in ("lo", "eth0"):
            self.check("ip", "-n", ns, "link", "set", dev, "up")
        self.hosts[name] = (ns, ip)
        return ip

    def on(self, host: str, cmd: list) -> list:
        """``cmd`` as run on ``host`` (its network namespace, its host name)."""
        ns = self.switch if host is None else self.hosts[host][0]
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', host or "switch", *cmd]

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
            left += [line.strip() for line in f if any(ns in line for ns in self.made)
                     or any(str(p) in line for p in self.paths)]
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
        for line in lines[last + 1:]:
            word, _, rest = line.strip().partition(" ")
            if word == "RUN":
                for command in rest.split("&&"):
                    args = shlex.split(command)
                    if args[:1] == ["useradd"]:
                        uid = args[args.index("--uid") + 1] if "--uid" in args else None
                        self.users[args[-1]] = int(uid)
                    if args[:2] == ["rm", "-f"] and any(a.startswith("/etc/ssh/ssh_host_")
                                                        for a in args):
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

    def __init__(self, net, spec: dict, name: str, base, image: Image, volumes: dict,
                 hosts_file: str, venv: str, labels=None):
        self.net, self.spec, self.name, self.dir = net, spec, name, base / name
        self.labels = labels or {}  # the pod's, for the downward API's fieldRef
        self.image, self.volumes, self.hosts_file, self.venv = image, volumes, hosts_file, venv
        self.proc = None
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
            lines.append(f"mount -t overlay overlay -o lowerdir=/{top},upperdir={d}/{top}/up,"
                         f"workdir={d}/{top}/work /{top}")
        # COPY --from=build /opt/hvdtrain/.venv: the build stage's venv (here, the checkout's
        # venv, where hvdtrain is installed too); the project's files beside it.
        (src, dst), = self.image.from_build
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
        lines.append(f"cp {q(self.hosts_file)} /etc/hosts")
        if self.image.host_keys_removed:  # the host's keys are not the image's
            lines.append("rm -f /etc/ssh/ssh_host_*")
        # The image's users (useradd): theirs alone are their uids (not the host's), their
        # homes in the image's /home; and /root traversable as in a Debian image (the
        # venv's interpreter may live under the host's /root).
        lines += ["mount -t tmpfs -o mode=755 tmpfs /home", "chmod 755 /root"]
        for user, uid in self.image.users.items():
            lines += [f"sed -i '/^[^:]*:[^:]*:{uid}:/d' /etc/passwd",
                      f"sed -i '/^[^:]*:[^:]*:{uid}:/d' /etc/group",
                      f"echo '{user}:x:{uid}:{uid}::/home/{user}:/bin/bash' >>/etc/passwd",
                      f"echo '{user}:x:{uid}:' >>/etc/group",
                      f"echo '{user}:*:20000:0:99999:7:::' >>/etc/shadow",
                      f"mkdir -p /home/{user}", f"chown {uid}:{uid} /home/{user}"]
        mounted = set()
        for m in c.get("volumeMounts", []):
            source, read_only = self.volumes[m["name"]]
            lines.append(f"mkdir -p {q(m['mountPath'])}")
            if source is None:  # emptyDir
                lines.append(f"mount -t tmpfs tmpfs {q(m['mountPath'])}")
            else:
                lines.append(f"mount --bind {q(str(source))} {q(m['mountPath'])}")
                if read_only or m.get("readOnly"):
                    lines.append(f"mount -o remount,bind,ro {q(m['mountPath'])}")
            mounted.add(m["mountPath"])
        # The checkout and its venv stay at their own paths too (the symlinks above, the
        # venv's scripts and its editable install name them): kept aside while /tmp and the
        # others are made private, then put back, so a checkout under /tmp (a CI clone) works.
        privates = [p for p in ("/run", "/dev/shm", "/tmp") if p not in mounted]
        keep = sorted({os.path.realpath(p) for p in (ROOT, self.venv)
                       if any(os.path.realpath(p).startswith(v + "/") for v in privates)})
        for i, path in enumerate(keep):
            lines += [f"mkdir -p /opt/.keep{i}", f"mount --bind {q(path)} /opt/.keep{i}"]
        for private in privates:  # last: the sources above are in /tmp
            lines.append(f"mount -t tmpfs -o mode=1777 tmpfs {private}")
        for i, path in enumerate(keep):
            lines += [f"mkdir -p {q(path)}", f"mount --bind /opt/.keep{i} {q(path)}"]
        env = dict(self.image.env, HOSTNAME=self.spec["hostname"], HOME=self.home())
        for e in c.get("env", []):
            env[e["name"]] = self._value(e)
        self.exec_prefix = self.user_prefix() + ["env", "-i"] + [
            f"{k}={v}" for k, v in env.items()]
        lines.append(f"cd {q(c.get('workingDir', self.image.workdir))}")
        lines.append("exec " + " ".join(map(q, self.exec_prefix)) + ' "$@"')
        script = d / "setup.sh"
        script.write_text("\n".join(lines) + "\n")
        return str(script)

    def security(self) -> dict:
        """The container's securityContext over the pod's (the container's fields win)."""
        return {**self.spec.get("securityContext", {}),
                **self.container.get("securityContext", {})}

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
                ["nsenter", f"--net={self.net.netns(self.name)}", "unshare", "--uts", "--mount",
                 "--pid", "--fork", "--kill-child", "--mount-proc", "sh", script, *cmd],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
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
            p = sh("nsenter", "-t", str(pid), "--net", "--uts", "--mount", "--pid", "--wd=/",
                   *self.exec_prefix, *probe["exec"]["command"],
                   timeout=probe.get("timeoutSeconds", 1) + 5)
            return p.returncode == 0
        port = probe["tcpSocket"]["port"]
        ip = self.net.hosts[self.name][1]
        p = sh(*self.net.on(None, ["bash", "-c", f"exec 3<>/dev/tcp/{ip}/{port}"]), timeout=10)
        return p.returncode == 0


class JobRun:
    """One set of pods for an MPIJob: what the operator and the kubelets start for it."""

    def __init__(self, net, base, job: dict, claims: dict, namespace="default",
                 venv=sys.prefix, job_uid=None):
        self.net, self.base, self.job, self.claims = net, base, job, claims
        # The launcher Job's UID: a retry (the Job's next pod) passes the first run's.
        self.job_uid = job_uid or str(uuid.uuid4())
        self.replaced = []  # launcher pods that replace_launcher took down (logs kept)
        self.namespace, self.venv = namespace, venv
        self.objects = operator_objects(job, namespace)
        self.image = Image()
        self.pods = {}
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
        p = sh("ssh-keygen", "-q", "-t", "ecdsa", "-b", "521", "-m", "PEM", "-N", "", "-C", "",
               "-f", str(key))
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
            elif "configMap" in v:
                data = made["configmap"]["data"]
                files = {i["path"]: (data[i["key"]], i.get("mode"))
                         for i in v["configMap"]["items"]}
                atomic_volume(where, files, v["configMap"].get("defaultMode", 0o644), 0o777)
                out[v["name"]] = (where, True)
            else:
                raise NotImplementedError(f"volume {v}")
        return out

    def _hosts_file(self, pod_name, spec, addresses, root=None):
        """The kubelet's /etc/hosts lines, then the cluster DNS's answers for this pod."""
        job, ns = self.job["metadata"]["name"], self.namespace
        fqdn = lambda n: f"{n}.{job}.{ns}.svc.cluster.local"  # noqa: E731
        lines = ["# Kubernetes-managed hosts file (emulated).", "127.0.0.1\tlocalhost",
                 "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{addresses[pod_name]}\t{fqdn(spec['hostname'])}\t{spec['hostname']}",
                 "# The cluster DNS's answers (headless Service %s):" % job]
        searches = spec.get("dnsConfig", {}).get("searches", [])
        for other, ip in addresses.items():
            if other == pod_name:
                continue
            # "<pod>.<job>.<namespace>.svc" resolves through the search domain cluster.local.
            names = [fqdn(other), f"{other}.{job}.{ns}.svc"]
            if f"{job}.{ns}.svc.cluster.local" in searches:
                names.append(other)
            lines.append(f"{ip}\t" + "\t".join(names))
        path = (root or self.base) / "hosts" / pod_name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    def start(self, ready_timeout=30):
        """Workers, then (once every one is ready) the launcher."""
        self.secret = self._keys()
        launcher_spec = self.objects["launcher"]["spec"]["template"]["spec"]
        specs = {w["metadata"]["name"]: w["spec"] for w in self.objects["workers"]}
        specs[launcher_spec["hostname"]] = launcher_spec
        addresses = {name: self.net.add_host(name) for name in specs}
        labels = {w["spec"]["hostname"]: w["metadata"]["labels"] for w in self.objects["workers"]}
        labels[launcher_spec["hostname"]] = self._launcher_labels()
        for name, spec in specs.items():
            self.pods[name] = Pod(self.net, spec, name, self.base, self.image,
                                  self._volumes(name, spec),
                                  self._hosts_file(name, spec, addresses), self.venv,
                                  labels.get(name))
        for w in self.workers:
            w.start()
        deadline = time.monotonic() + ready_timeout
        while not all(w.ready() for w in self.workers):
            dead = [w for w in self.workers if w.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.fail("workers not ready:\n" + "\n".join(
                    f"--- {w.name} (rc {w.proc.poll()})\n{w.log()}" for w in self.workers))
            time.sleep(0.1)
        self.launcher.start()
        return self

    def _launcher_labels(self) -> dict:
        """The launcher pod's: its template's, and the Job controller's (Kubernetes 1.27+)."""
        launcher = self.objects["launcher"]
        return {**launcher["spec"]["template"]["metadata"]["labels"],
                "batch.kubernetes.io/controller-uid": self.job_uid,
                "batch.kubernetes.io/job-name": launcher["metadata"]["name"],
                "controller-uid": self.job_uid, "job-name": launcher["metadata"]["name"]}

    def replace_launcher(self):
        """The launcher's node gone at once, then the Job's next launcher pod. The old pod's
        network is cut before its processes die, so that the workers see no connection close
        (as from a dead node: their daemons and ranks go on for minutes); the new pod has a
        new address, the same workers. Returns the old pod (its log stays readable)."""
        old = self.launcher
        ns, _ = self.net.hosts[old.name]
        self.net.check("ip", "-n", ns, "link", "set", "eth0", "down")
        old.kill()
        self.net.remove_host(old.name)
        self.replaced.append(old)
        root = self.base / f"retry{len(self.replaced)}"
        root.mkdir()
        spec = self.objects["launcher"]["spec"]["template"]["spec"]
        self.net.add_host(old.name)
        addresses = {name: self.net.hosts[name][1] for name in self.pods}
        new = Pod(self.net, spec, old.name, root, self.image, self._volumes(old.name, spec, root),
                  self._hosts_file(old.name, spec, addresses, root), self.venv,
                  self._launcher_labels())
        self.pods[old.name] = new
        new.start()
        return old

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{p.log()}" for name, p in self.pods.items())

    def delete(self, grace: float) -> dict:
        """Delete every pod as Kubernetes does: SIGTERM to each PID 1 at once, SIGKILL what is
        left after ``grace`` s. {pod: its container's exit status (None: killed)}."""
        for p in self.pods.values():
            p.sigterm()
        deadline = time.monotonic() + grace
        statuses = {}
        for name, p in self.pods.items():
            statuses[name] = p.wait(max(0.0, deadline - time.monotonic()))
        self.remove()
        return statuses

    def remove(self):
        """Kill whatever is left and remove the pods' namespaces."""
        for name, p in self.pods.items():
            p.kill()
            if name in self.net.hosts:
                self.net.remove_host(name)
