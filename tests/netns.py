"""Hosts on one machine for the multi-host tests: network namespaces with their own host names.

``Hosts(base, {"hostA": "10.77.0.1", "hostB": "10.77.0.2"}, tag="hvdt")`` makes one network
namespace per host, joined by a veth pair (two hosts) or by veths into a bridge in a namespace of
its own (three or more), each host's end named ``iface`` and addressed as given. The root
namespace (and the machine's real interfaces) are never touched: traffic stays between the
namespaces the test made.

A command "on" a host runs in its network namespace and in a UTS namespace named after it.
Two ways in, as the tests need them:

- ``ip netns exec`` (``on``): the host also sees its own /etc/hosts (``etc_hosts=True`` writes
  /etc/netns/NS/hosts with every host's name, which ``ip netns exec`` bind-mounts), so each host
  name resolves to its veth address, as on real machines;
- ``nsenter --net`` (``on(..., nsenter=True)``): /sys stays as it is (``ip netns exec`` remounts
  it, hiding /sys/fs/cgroup, which slurmd's cgroup plugin needs).

Daemons (``start``) are children of the test process, run in the foreground with their output
in ``base``. ``destroy`` kills them and everything left in the namespaces, deletes the
namespaces and what was made for them, and checks that no process, namespace or mount of the
hosts is left (``leftovers``).

``Cluster`` is the shape of the Ray and Spark clusters over ``Hosts``: a head and worker nodes,
one daemon a node started in a clean environment, a node lost (``remove_node``: SIGKILL to its
namespace's every process) and back (``add_node``).
"""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from conftest import TIME_SCALE

NETNS_ETC = "/etc/netns"

SSHD_CONFIG = """ListenAddress {address}
Port 22
HostKey {dir}/host_key
PidFile none
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
"""


def sh(*cmd, timeout=30, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


class Hosts:
    def __init__(self, base, hosts, tag, iface, etc_hosts=False):
        self.base = base
        self.hosts = dict(hosts)  # name -> address
        tag = f"{tag}{os.getpid()}"
        self.ns = {h: f"{tag}{chr(ord('a') + i)}" for i, h in enumerate(self.hosts)}
        self.switch = f"{tag}s" if len(self.hosts) > 2 else None
        self.iface = iface
        self.etc_hosts = etc_hosts
        self.daemons = []  # (name, Popen)
        self.made = []  # (kind, what): cleanup actions, newest last

    # --- making them ----------------------------------------------------------------------
    def create(self):
        for ns in [*self.ns.values(), *([self.switch] if self.switch else [])]:
            p = sh("ip", "netns", "add", ns)
            if p.returncode != 0:
                pytest.skip(
                    f"cannot make network namespaces here (needs root with "
                    f"CAP_SYS_ADMIN): ip netns add: {p.stderr.strip()}"
                )
            self.made.append(("netns", ns))
        if sh("unshare", "--uts", "true").returncode != 0:
            pytest.skip("cannot make UTS namespaces here (unshare --uts needs CAP_SYS_ADMIN)")
        names = list(self.ns.values())
        if self.switch is None:  # two hosts: one veth pair straight between them
            self.check(
                "ip",
                "-n",
                names[0],
                "link",
                "add",
                self.iface,
                "type",
                "veth",
                "peer",
                "name",
                self.iface,
                "netns",
                names[1],
            )
        else:  # a bridge in its own namespace, a veth from it to each host
            self.check("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            self.check("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(names):
                port = f"p{i}"
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
                    self.iface,
                    "netns",
                    ns,
                )
                self.check("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                self.check("ip", "-n", self.switch, "link", "set", port, "up")
        for host, ns in self.ns.items():
            self.check("ip", "-n", ns, "addr", "add", f"{self.hosts[host]}/24", "dev", self.iface)
            self.check("ip", "-n", ns, "link", "set", "lo", "up")
            self.check("ip", "-n", ns, "link", "set", self.iface, "up")
            if self.etc_hosts:
                self.write_etc_hosts(ns, self.hosts)
        return self

    def write_etc_hosts(self, ns, names):
        """/etc/netns/NS/hosts: what ``ip netns exec NS`` shows as /etc/hosts."""
        if not os.path.isdir(NETNS_ETC):
            os.mkdir(NETNS_ETC)
            self.made.append(("rmdir", NETNS_ETC))
        d = os.path.join(NETNS_ETC, ns)
        if not os.path.isdir(d):
            os.mkdir(d)
            self.made.append(("rmtree", d))
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write(
                "127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in names.items())
            )

    def check(self, *cmd):
        p = sh(*cmd)
        assert p.returncode == 0, f"{' '.join(cmd)}: {p.stderr}"

    # --- using them -----------------------------------------------------------------------
    def on(self, host, cmd, nsenter=False, env=()):
        """``cmd`` as run on ``host``: its network namespace, its host name, then ``env``
        (NAME=value strings) set for ``cmd``."""
        enter = (
            ["nsenter", f"--net=/run/netns/{self.ns[host]}"]
            if nsenter
            else ["ip", "netns", "exec", self.ns[host]]
        )
        return [
            *enter,
            "unshare",
            "--uts",
            *(["env", *env] if env else []),
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            host,
            *cmd,
        ]

    def start(self, name, cmd):
        """A daemon in the foreground, its output in base/NAME.out."""
        with open(self.base / f"{name.replace(' ', '-')}.out", "w") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.daemons.append((name, proc))
        return proc

    def wait(self, predicate, timeout, what):
        """Poll ``predicate`` for ``timeout`` s (stop early if a daemon died); fail with the
        daemons' logs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if any(p.poll() is not None for _, p in self.daemons):
                break
            time.sleep(0.1)
        logs = "\n".join(
            f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}"
            for f in sorted(self.base.glob("**/*"))
            if f.is_file() and (f.name == "log" or f.suffix in (".out", ".log"))
        )
        pytest.fail(f"{type(self).__name__}: no {what} within {timeout}s\n{logs}")

    def rx_bytes(self, host):
        """Bytes ``host`` received on its veth so far."""
        stats = json.loads(
            sh("ip", "-n", self.ns[host], "-s", "-j", "link", "show", self.iface).stdout
        )
        return stats[0]["stats64"]["rx"]["bytes"]

    def start_sshd(self, host, keys, authorized=None, name="sshd"):
        """A real sshd (Debian's) on ``host``, listening on its address; its host key and
        configuration in ``keys``, the user keys it accepts in ``authorized`` (default
        keys/authorized_keys). Returns its log's path once it listens."""
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.access(sshd, os.X_OK):
            pytest.fail(
                "sshd missing: apt-get install openssh-server (scripts/setup.sh installs it)"
            )
        if not (keys / "host_key").exists():
            self.check("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "host_key"))
        config = keys / f"{name}_config"
        text = SSHD_CONFIG.format(address=self.hosts[host], dir=keys)
        if authorized:
            text = text.replace(f"{keys}/authorized_keys", str(authorized))
        config.write_text(text)
        if not os.path.isdir("/run/sshd"):  # sshd's privilege separation directory
            os.mkdir("/run/sshd", 0o755)
            self.made.append(("rmdir", "/run/sshd"))
        log = self.base / f"{name}.out"
        self.start(name, self.on(host, [sshd, "-D", "-e", "-f", str(config)]))
        self.wait(lambda: "Server listening" in log.read_text(), 10, f"{name} listening")
        return log

    # --- removing them --------------------------------------------------------------------
    def stop_gracefully(self, procs, seconds):
        """SIGTERM to each of ``procs`` still running (daemons that stop what they started),
        then up to ``seconds`` for them all; ``destroy`` kills what is left."""
        procs = list(procs)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + seconds
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    @staticmethod
    def temp_left(temp):
        """``temp`` (a directory outside ``base``: short paths) and the processes whose
        command line names it, while they are there."""
        if not temp:
            return []
        left = [temp] if os.path.exists(temp) else []
        marker = temp.encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker in f.read():
                        left.append(f"pid {pid}")
            except OSError:
                pass
        return left

    def destroy(self):
        namespaces = [what for kind, what in self.made if kind == "netns"]
        for ns in namespaces:
            # Anything running in a namespace the test made is the test's own.
            for pid in sh("ip", "netns", "pids", ns).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
        for _, proc in reversed(self.daemons):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=10)
        for kind, what in reversed(self.made):
            if kind == "netns":
                sh("ip", "netns", "del", what)  # takes the veth ends inside with it
            elif kind == "rmtree":
                shutil.rmtree(what, ignore_errors=True)
            elif kind == "rmdir":
                try:
                    os.rmdir(what)
                except OSError:
                    pass
        left = self.leftovers()
        assert not left, f"the test's hosts left behind: {left}"

    def leftovers(self):
        """Processes, namespaces and mounts of these hosts still there (none, after destroy)."""
        listed = sh("ip", "netns", "list").stdout.split()
        mine = [*self.ns.values(), *([self.switch] if self.switch else [])]
        left = [ns for ns in mine if ns in listed]
        left += [
            os.path.join(NETNS_ETC, ns)
            for ns in mine
            if os.path.exists(os.path.join(NETNS_ETC, ns))
        ]
        with open("/proc/mounts") as f:
            left += [
                line.strip()
                for line in f
                if str(self.base) in line or any(f"/{ns} " in line for ns in mine)
            ]
        marker = str(self.base).encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue  # a zombie holds nothing; its parent reaps it
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read()
            except OSError:
                continue
            if marker in cmdline or marker in environ:
                args = cmdline.replace(b"\0", b" ").decode(errors="replace")
                left.append(f"pid {pid}: {args}")
        return left


class Cluster(Hosts):
    """A head and worker nodes on ``Hosts``, one daemon a node (``start_node``, by the subclass,
    calls ``launch``). The node's daemon output is base/NAME-N.out, N its start's number."""

    def __init__(self, base, nodes, head, tag, iface, env, stop_seconds):
        super().__init__(base, nodes, tag=tag, iface=iface, etc_hosts=True)
        self.head = head
        self.env = env  # the daemons' whole environment (``on_node``)
        self.stop_seconds = stop_seconds  # SIGTERM to the daemons, then this, then SIGKILL
        self.temp = None  # everything the daemons write is under it (short paths)
        self.nodes = {}  # name -> its daemon (Popen), while it runs
        self.starts = 0  # daemon starts so far (each its own output file)
        self.commands = {}  # name -> the daemon's latest command line

    def create(self, prefix):
        super().create()
        (self.base / "home").mkdir()
        self.temp = tempfile.mkdtemp(prefix=prefix)
        self.made.append(("rmtree", self.temp))

    def launch(self, name, cmd, **extra):
        """Node ``name``'s daemon ``cmd``, with ``extra`` added to the environment."""
        self.starts += 1
        self.commands[name] = cmd
        self.nodes[name] = self.start(f"{name}-{self.starts}", self.on_node(name, cmd, **extra))
        return self.nodes[name]

    def on_node(self, name, cmd, **extra):
        """``cmd`` on host ``name`` with this cluster's environment only."""
        env = {**self.env, **extra}
        return self.on(name, ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *cmd])

    def wait_log(self, name, text, timeout):
        """Until node ``name``'s latest daemon has printed ``text``."""
        log = self.base / f"{name}-{self.starts}.out"
        self.wait(
            lambda: text in log.read_text(errors="replace"),
            timeout * TIME_SCALE,
            f"'{text}' from {name}",
        )

    def logs(self):
        return "\n".join(
            f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}"
            for f in sorted(self.base.glob("*.out"))
        )

    def pids(self, name=None):
        """The processes of host ``name`` (default: every host)."""
        return [
            int(p)
            for n in ([name] if name else self.hosts)
            for p in sh("ip", "netns", "pids", self.ns[n]).stdout.split()
        ]

    def rss(self, name=None):
        """Resident memory (bytes) of the processes of host ``name`` (default: every host)."""
        total = 0
        for pid in self.pids(name):
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass
        return total

    def kill(self, name, spare=lambda pid: False):
        """SIGKILL to host ``name``'s processes but those ``spare`` keeps, until none is left
        (a process forking as it is killed: its child in turn). Returns the pids killed."""
        killed = set()
        for _ in range(10):
            pids = [p for p in self.pids(name) if not spare(p)]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        return sorted(killed)

    def remove_node(self, name):
        """Worker node ``name`` lost: SIGKILL to every process of its namespace, its daemon
        too (nothing of it stops the rest in order)."""
        assert name != self.head, "the head is the cluster"
        proc = self.nodes.pop(name)
        self.kill(name)
        proc.wait(timeout=30)
        self.daemons = [(n, p) for n, p in self.daemons if p is not proc]
        left = self.pids(name)
        assert not left, f"{name}: processes left after SIGKILL: {left}"

    def add_node(self, name):
        """Worker node ``name`` back: a fresh daemon."""
        assert name not in self.nodes, f"{name} is running"
        return self.start_node(name)

    def start_node(self, name):
        raise NotImplementedError

    def destroy(self):
        # The daemons stop what they started on SIGTERM.
        self.stop_gracefully(self.nodes.values(), self.stop_seconds * TIME_SCALE)
        super().destroy()  # SIGKILL to what is left; the namespaces, the temp dir; checks

    def leftovers(self):
        return super().leftovers() + self.temp_left(self.temp)
