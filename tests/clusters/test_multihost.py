"""Two hosts on one machine: one rank on each, launched as on a cluster.

The test makes two network namespaces joined by a veth pair, nothing else: hostA
(10.77.0.1) and hostB (10.77.0.2). Every command "on" a host runs in its namespace and in
its own UTS namespace named after it, and sees its own /etc/hosts (``ip netns exec``
bind-mounts /etc/netns/NS/hosts), so each rank has a host name that resolves to its veth
address, as on real machines. The launcher runs on hostA, like a cluster's first node:

- Open MPI's ``mpirun -H hostA,hostB``, whose launch agent (``plm_rsh_agent``) enters
  hostB's namespace with a fresh environment instead of ssh-ing to it;
- ``scripts/launch_cluster.sh`` with a hostfile and the same agent;
- ``horovodrun --gloo -H hostA:1,hostB:1``, which reaches hostB through a real sshd the
  test runs there (its own host and user keys; the client settings a cluster would keep
  in ~/.ssh/config go to a test-made config through an ``ssh`` wrapper on PATH).

The weights must equal the one-host two-process run's within 1e-5 (2 epochs, not yet
converged), the traffic must have crossed the veth, and rank 1 must have reached rank 0's
watchdog (no "watchdog unreachable" warning).
"""
import os
import shutil
import sys

import numpy as np
import pytest

from conftest import HOROVODRUN, ROOT, clean_env, module_cmd, result, run
from netns import Hosts

# The first test's bound also covers the module's fixtures: daemons started (the hosts, their
# sshd or SLURM's), and the reference runs. Twice pytest.ini's.
pytestmark = pytest.mark.timeout(600)

ARGS = ["--epochs", "2", "--learning-rate", "0.1"]
HOSTS = {"hostA": "10.77.0.1", "hostB": "10.77.0.2"}
IFACE = "hvdt0"  # the veth's name in both namespaces

AGENT = """#!/bin/sh
# Open MPI launch agent: "AGENT [options] HOST COMMAND..." runs COMMAND on HOST, as ssh
# would: in HOST's namespaces, with a fresh login environment.
echo "$*" >> {log}
while [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done
host=$1; shift
case $host in {cases}
  *) echo "agent: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$HOME" \\
    sh -c "hostname $host && $*"
"""

SSH_CONFIG = """Host {hosts}
  IdentityFile {dir}/user_key
  UserKnownHostsFile {dir}/known_hosts
  BatchMode yes
  LogLevel ERROR
"""


class Cluster(Hosts):
    def __init__(self, base):
        super().__init__(base, HOSTS, tag="hvdt", iface=IFACE, etc_hosts=True)
        self.agent = base / "agent.sh"
        self.agent_log = base / "agent.log"
        self.bin = base / "bin"  # the ssh wrapper
        self.sshd_log = None

    def create(self):
        super().create()
        cases = " ".join(f"{h}|{HOSTS[h]}) ns={ns} ;;" for h, ns in self.ns.items())
        self.agent.write_text(AGENT.format(log=self.agent_log, cases=cases))
        self.agent.chmod(0o755)
        return self

    def start_sshd(self, host="hostB"):
        """A real sshd on ``host``, with keys made here, and the client settings for it."""
        d = self.base
        self.check("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "user_key"))
        shutil.copy(d / "user_key.pub", d / "authorized_keys")
        (d / "ssh_config").write_text(SSH_CONFIG.format(hosts=" ".join(HOSTS), dir=d))
        self.bin.mkdir()
        (self.bin / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {d}/ssh_config "$@"\n')
        (self.bin / "ssh").chmod(0o755)
        self.sshd_log = super().start_sshd(host, d)


def horovodrun_args(argv):
    """What horovodrun's own parser makes of its arguments ARGV (it exits on a bad one)."""
    from horovod.runner import launch
    saved, sys.argv = sys.argv, ["horovodrun", *argv]
    try:
        return launch.parse_args()
    finally:
        sys.argv = saved


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c.create()
    finally:
        c.destroy()


@pytest.fixture(scope="module")
def reference(references):
    """The one-host two-process run the two-host runs must reproduce (the session's shared
    reference: the SLURM tests and the parity test compare against the same run)."""
    r = references.run("gloo", 2, "linear", *ARGS)
    assert r["world_size"] == 2 and abs(r["weights"][2] - 0.3) > 0.05  # not yet converged
    return r


def check_two_host_run(p, run_dir, reference, cluster, rx_before):
    assert p.returncode == 0, p.stdout + p.stderr
    assert "watchdog unreachable" not in p.stderr and "hvdtrain: warning" not in p.stderr, p.stderr
    r = result(run_dir)
    assert (r["world_size"], r["backend"], r["global_step"]) == (2, "horovod", 2)
    np.testing.assert_allclose(r["weights"], reference["weights"], atol=1e-5)
    assert abs(r["bias"] - reference["bias"]) < 1e-5
    # The ranks talked over the veth (Horovod's negotiation and allreduce, the watchdog).
    assert cluster.rx_bytes("hostB") - rx_before > 10_000
    return r


def mpi_env(cluster, tmp_path):
    # hostB's processes get only what mpirun forwards (-x), as over ssh.
    return clean_env(tmp_path / "home", OMPI_MCA_plm_rsh_agent=str(cluster.agent))


def test_mpirun_across_two_hosts(cluster, reference, tmp_path):
    env = mpi_env(cluster, tmp_path)
    rx = cluster.rx_bytes("hostB")
    cmd = ["mpirun", "-np", "2", "-H", "hostA,hostB", "--allow-run-as-root",
           "--bind-to", "none", "--map-by", "slot", "--mca", "plm_rsh_agent", str(cluster.agent),
           "--mca", "pml", "ob1", "--mca", "btl", "^openib",
           "--mca", "btl_tcp_if_include", IFACE, "--mca", "oob_tcp_if_include", IFACE,
           "-x", "PATH", "-x", "PYTHONPATH", "-x", "HOME", "-x", "TF_CPP_MIN_LOG_LEVEL",
           "-x", "PYTHONUNBUFFERED",
           *module_cmd("linear", "--run-dir", str(tmp_path / "r"), *ARGS)]
    p = run(cluster.on("hostA", cmd), env)
    check_two_host_run(p, tmp_path / "r", reference, cluster, rx)
    assert "Horovod over mpi" in p.stdout
    launched = cluster.agent_log.read_text().splitlines()
    assert any(l.startswith("hostB ") and " orted " in l for l in launched), launched


def test_launch_cluster_script_across_two_hosts(cluster, reference, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("hostA slots=1\nhostB slots=1\n")
    env = dict(mpi_env(cluster, tmp_path), IFACE=IFACE, PYTHON=sys.executable)
    rx = cluster.rx_bytes("hostB")
    cmd = ["bash", os.path.join(ROOT, "scripts", "launch_cluster.sh"), str(hostfile), "linear",
           "--run-dir", str(tmp_path / "r"), *ARGS]
    p = run(cluster.on("hostA", cmd), env)
    check_two_host_run(p, tmp_path / "r", reference, cluster, rx)


def test_horovodrun_gloo_across_two_hosts_over_ssh(cluster, reference, tmp_path):
    cluster.start_sshd("hostB")
    env = clean_env(tmp_path / "home")
    env["PATH"] = f"{cluster.bin}{os.pathsep}{env['PATH']}"  # the ssh wrapper first
    rx = cluster.rx_bytes("hostB")
    cmd = [HOROVODRUN, "--gloo", "-np", "2", "-H", "hostA:1,hostB:1",
           "--network-interface", IFACE,
           *module_cmd("linear", "--run-dir", str(tmp_path / "r"), *ARGS)]
    p = run(cluster.on("hostA", cmd), env)
    check_two_host_run(p, tmp_path / "r", reference, cluster, rx)
    assert "Horovod over gloo" in p.stdout
    # horovodrun checked ssh, then started its task service and rank 1 on hostB over it.
    assert cluster.sshd_log.read_text().count("Accepted publickey") >= 2
