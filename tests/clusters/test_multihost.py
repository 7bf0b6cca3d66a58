"""Two hosts on one machine: one rank on each, launched as on a cluster.

The test makes two network namespaces joined by a veth pair, nothing else: hostA
(10.77.0.1) and hostB (10.77.0.2). Every command "on" a host runs in its namespace and in
its own UTS namespace named after it, and sees its own /etc/hosts (``ip netns exec``
bind-mounts /etc/netns/NS/hosts), so each rank has a host name that resolves to its veth
address, as on real machines. The launcher runs on hostA, like a cluster's first node:

- the README's cluster commands as printed, for these two hosts (one process on each: ``-np
  2``, a hostfile of ``hostA slots=1`` and ``hostB slots=1``, ``-H hostA:1,hostB:1``, the veth
  for eth0): Open MPI's ``mpirun --hostfile hosts -x PATH``, whose launch agent
  (``plm_rsh_agent``) enters hostB's namespace with a fresh login environment instead of
  ssh-ing to it, and ``horovodrun -H`` (MPI, and ``--gloo`` as the MPI guide prints it), which
  reaches hostB through a real sshd the test runs there (its own host and user keys; the
  client settings a cluster would keep in ~/.ssh/config go to a test-made config through an
  ``ssh`` wrapper on PATH); each must end with the README's one-host two-process run's
  weights, bit for bit (tests/runs/test_multiprocess.py runs it: the session's reference);
- ``scripts/launch_cluster.sh`` with a hostfile and the same agent, on the linear task: the
  weights must equal the one-host two-process run's within 1e-5 (2 epochs, not yet
  converged).

Each run's traffic must have crossed the veth, and rank 1 must have reached rank 0's
watchdog (no "watchdog unreachable" warning).

The launch_cluster.sh command is the MPI guide's (docs/guides/clusters/mpi.md), with this test's
hosts, interface, task and flags; the guide's other commands are run with DRY_RUN or a recording
horovodrun, and its horovodrun lines parsed by horovodrun's own parser.
"""

import os
import re
import shlex
import shutil
import sys

import numpy as np
import pytest

import rank_env
from conftest import ROOT, as_printed, clean_env, default_run_dirs, result, run
from docs_pages import block
from netns import Hosts

# The first test's bound also covers the module's fixtures: daemons started (the hosts, their
# sshd or SLURM's), and the reference runs. Twice pyproject.toml's (pytest's timeout).
pytestmark = pytest.mark.timeout(600)

ARGS = ["--epochs", "2", "--learning-rate", "0.1"]
HOSTS = {"hostA": "10.77.0.1", "hostB": "10.77.0.2"}
IFACE = "hvdt0"  # the veth's name in both namespaces

AGENT = """#!/bin/sh
# Open MPI launch agent: "AGENT [options] HOST COMMAND..." runs COMMAND on HOST, as ssh
# would: in HOST's namespaces, with a fresh login environment (PYTHONPATH: the checkout
# under test, which a cluster's hosts would have installed in the venv).
echo "$*" >> {log}
while [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done
host=$1; shift
case $host in {cases}
  *) echo "agent: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$HOME" \\
    PYTHONPATH={root} sh -c "hostname $host && $*"
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
        self.agent.write_text(AGENT.format(log=self.agent_log, cases=cases, root=ROOT))
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


# The guide's overview, its launch_cluster.sh block and its horovodrun block.
OVERVIEW = block(
    "guides/clusters/mpi.md", "# one host, the configured number of workers"
).commands()
LAUNCH_CLUSTER_BLOCK = block("guides/clusters/mpi.md", "# hosts: one line per host")
LAUNCH_CLUSTER = LAUNCH_CLUSTER_BLOCK.commands()
HOROVODRUN_LINES = block(
    "guides/clusters/mpi.md", "horovodrun -np 8 -H node1:4,node2:4 "
).commands()


def horovodrun_args(argv):
    """What horovodrun's own parser makes of its arguments ARGV (it exits on a bad one)."""
    from horovod.runner import launch

    saved, sys.argv = sys.argv, ["horovodrun", *argv]
    try:
        return launch.parse_args()
    finally:
        sys.argv = saved


def slots(hosts):
    """The slots of horovodrun's -H: "node1:4,node2:4" has 8."""
    return sum(int(h.split(":")[1]) for h in hosts.split(","))


@pytest.mark.timeout(120)
def test_the_mpi_guides_commands(tmp_path):
    """The guide's overview repeats its launch_cluster.sh and horovodrun lines. Its DRY_RUN
    line, run as printed where a hostfile of its comment's form is, prints the mpirun command
    the guide describes (the task's 2 workers, the hostfile, no binding, slots filled host by
    host, plain TCP, the environment forwarded), and its IFACE line (dry, the data directory
    one of this machine) the interface for MPI's data and control, NCCL and Gloo.
    launch_local.sh, as printed, starts the task's configured 2 workers through horovodrun (a
    recording one). Each horovodrun line parses, -np its hosts' slots, and its module exists;
    the Gloo one is the other with --gloo."""
    local, cluster, hvdrun = OVERVIEW
    assert cluster == LAUNCH_CLUSTER[0] and hvdrun == HOROVODRUN_LINES[0]
    host_line = re.search(r'"(\w+ slots=\d+)"', LAUNCH_CLUSTER_BLOCK.text).group(1)
    (tmp_path / "hosts").write_text(f"{host_line}\n{host_line.replace('1', '2', 1)}\n")
    (tmp_path / "scripts").symlink_to(os.path.join(ROOT, "scripts"))
    env = clean_env(tmp_path / "home", PYTHON=sys.executable)

    def printed(line):
        p = run(["bash", "-c", line], env, timeout=60, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        return shlex.split(p.stdout)

    dry = LAUNCH_CLUSTER[1]
    assert dry.startswith("DRY_RUN=1 ") and dry.endswith(" hosts mnist"), dry
    words = printed(dry)
    assert words[:17] == [
        "mpirun",
        "-np",
        "2",
        "--hostfile",
        "hosts",
        "--bind-to",
        "none",
        "--map-by",
        "slot",
        "-x",
        "NCCL_DEBUG=WARN",
        "--mca",
        "pml",
        "ob1",
        "--mca",
        "btl",
        "^openib",
    ], words
    assert words[-4:] == [sys.executable, "-m", "hvdtrain", "mnist"], words
    assert {"PATH", "PYTHONPATH"} <= {words[i + 1] for i, w in enumerate(words) if w == "-x"}
    assert "btl_tcp_if_include" not in words
    data = tmp_path / "mnist"
    data.mkdir()
    iface_line = cluster.replace("/shared/mnist", str(data))
    iface = re.match(r"IFACE=(\w+) ", iface_line).group(1)
    words = printed("DRY_RUN=1 " + iface_line)
    for setting in (
        ["--mca", "btl_tcp_if_include", iface],
        ["--mca", "oob_tcp_if_include", iface],
        ["-x", f"NCCL_SOCKET_IFNAME={iface}"],
        ["-x", f"HOROVOD_GLOO_IFACE={iface}"],
    ):
        assert " ".join(setting) in " ".join(words), (setting, words)
    assert words[-6:] == [sys.executable, "-m", "hvdtrain", "mnist", "--data-dir", str(data)]

    fake = tmp_path / "fake"  # PYTHON's directory: this interpreter, and a horovodrun that records
    fake.mkdir()
    (fake / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (fake / "horovodrun").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" >{tmp_path}/horovodrun.args\n'
    )
    for f in ("python", "horovodrun"):
        (fake / f).chmod(0o755)
    assert local.startswith("scripts/launch_local.sh "), local
    p = run(["bash", "-c", local], dict(env, PYTHON=str(fake / "python")), timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "horovodrun.args").read_text().split() == [
        "-np",
        "2",
        str(fake / "python"),
        "-m",
        "hvdtrain",
        *shlex.split(local)[1:],
    ]

    for line in HOROVODRUN_LINES:
        words = shlex.split(line)
        args = horovodrun_args(words[1:])
        assert args.num_proc == slots(args.hosts) and args.nics == {iface}, line
        assert args.command[:2] == ["python", "-m"] and os.path.exists(
            os.path.join(ROOT, *args.command[2].split(".")) + ".py"
        ), line
    plain, gloo = map(shlex.split, HOROVODRUN_LINES)
    assert horovodrun_args(gloo[1:]).use_gloo and [w for w in gloo if w != "--gloo"] == plain


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


@pytest.fixture(scope="module")
def readme_run(references):
    """The README's main command on this host (``horovodrun -np 2 python -m hvdtrain.mnist``),
    which the README's cluster commands must reproduce on two: the session's shared run."""
    line = block("README.md", "horovodrun -np 2 python -m hvdtrain.mnist").commands()[0]
    p, cwd = references.printed(line)
    assert p.returncode == 0, p.stderr[-3000:]
    (run_dir,) = default_run_dirs(cwd, "mnist")
    return result(run_dir)


def for_two_hosts(line):
    """A README cluster command for the two hosts here: its 8 processes on node1 and node2 (4
    each) one on each of hostA and hostB, its eth0 the veth between them; nothing else
    changes."""
    words = as_printed(line)
    assert "-np" in words, line
    for flag, printed, here in (
        ("-np", "8", "2"),
        ("-H", "node1:4,node2:4", "hostA:1,hostB:1"),
        ("--network-interface", "eth0", IFACE),
    ):
        if flag in words:
            assert words[words.index(flag) + 1] == printed, (flag, line)
            words[words.index(flag) + 1] = here
    return words


def check_readme_run(p, cwd, readme_run, cluster, rx_before):
    """A README cluster command's two-host run ended as the one-host run did."""
    assert p.returncode == 0, p.stdout + p.stderr
    assert "watchdog unreachable" not in p.stderr and "hvdtrain: warning" not in p.stderr, p.stderr
    (run_dir,) = default_run_dirs(cwd, "mnist")
    r = result(run_dir)
    assert (r["world_size"], r["global_step"], r["ranks_identical"]) == (2, 200, True)
    # The same weights, bit for bit: two ranks' sums are the same in any order.
    assert r["weights_sha256"] == readme_run["weights_sha256"]
    assert r["test_accuracy"] == readme_run["test_accuracy"]
    assert cluster.rx_bytes("hostB") - rx_before > 10_000  # the ranks talked over the veth


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


def test_the_readmes_mpirun_across_two_hosts(cluster, readme_run, tmp_path):
    """``mpirun -np 8 --hostfile hosts -x PATH python -m hvdtrain.mnist``, for two hosts; a
    fresh login environment on hostB: -x PATH is what finds the venv's python there."""
    line = block("README.md", "mpirun -np 8 --hostfile hosts").commands()[0]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "hosts").write_text("hostA slots=1\nhostB slots=1\n")  # "node1 slots=4", here
    rx = cluster.rx_bytes("hostB")
    p = run(cluster.on("hostA", for_two_hosts(line)), mpi_env(cluster, tmp_path), cwd=cwd)
    check_readme_run(p, cwd, readme_run, cluster, rx)
    assert "Horovod over mpi" in p.stdout
    launched = cluster.agent_log.read_text().splitlines()
    assert any(l.startswith("hostB ") and " orted " in l for l in launched), launched


def test_launch_cluster_script_across_two_hosts(cluster, reference, tmp_path):
    """The MPI guide's launch_cluster.sh on two hosts trains as one host does; hostB's rank,
    which has only what mpirun's -x forwards, starts with glibc's huge-page tunable too."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("hostA slots=1\nhostB slots=1\n")
    # The guide's command: its variable for this test's interface, its script from this
    # checkout, this test's hostfile, task and flags.
    variable, script, hosts, *_ = shlex.split(LAUNCH_CLUSTER[0])
    assert (variable.split("=")[0], script, hosts) == (
        "IFACE",
        "scripts/launch_cluster.sh",
        "hosts",
    )
    env = rank_env.logging(
        dict(mpi_env(cluster, tmp_path), IFACE=IFACE, PYTHON=sys.executable), tmp_path
    )
    rx = cluster.rx_bytes("hostB")
    cmd = [
        "bash",
        os.path.join(ROOT, script),
        str(hostfile),
        "linear",
        "--run-dir",
        str(tmp_path / "r"),
        *ARGS,
    ]
    p = run(cluster.on("hostA", cmd), env)
    check_two_host_run(p, tmp_path / "r", reference, cluster, rx)
    rank_env.assert_launcher_set_it(tmp_path, 2)


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_the_readmes_horovodrun_across_two_hosts_over_ssh(
    cluster, readme_run, tmp_path, controller
):
    """``horovodrun -np 8 -H node1:4,node2:4 --network-interface eth0 python -m
    hvdtrain.mnist``, for two hosts: as the README prints it (MPI underneath), and as the MPI
    guide prints it with ``--gloo``."""
    if cluster.sshd_log is None:
        cluster.start_sshd("hostB")
    # MPI: the README's line; Gloo: the MPI guide's Gloo line (the README's with --gloo).
    line = (
        block("README.md", "mpirun -np 8 --hostfile hosts").commands()[1]
        if controller == "mpi"
        else HOROVODRUN_LINES[1]
    )
    words = for_two_hosts(line)
    assert words[0] == "horovodrun" and ("--gloo" in words) == (controller == "gloo")
    env = rank_env.logging(clean_env(tmp_path / "home"), tmp_path)
    env["PATH"] = f"{cluster.bin}{os.pathsep}{env['PATH']}"  # the ssh wrapper first
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    accepted = cluster.sshd_log.read_text().count("Accepted publickey")
    rx = cluster.rx_bytes("hostB")
    p = run(cluster.on("hostA", words), env, cwd=cwd)
    check_readme_run(p, cwd, readme_run, cluster, rx)
    assert f"Horovod over {controller}" in p.stdout
    # horovodrun checked ssh, then started rank 1 on hostB over it (MPI: mpirun's daemon).
    assert cluster.sshd_log.read_text().count("Accepted publickey") - accepted >= 2
    # Each rank, on either host, started again with glibc's huge-page tunable (bare horovodrun
    # gives it none): hvdtrain/base/malloc.py.
    starts = rank_env.starts(tmp_path)
    assert len(starts) == 2 and all(v[-1] == rank_env.expected() for v in starts.values())
    assert all(len(v) == (1 if rank_env.expected() is None else 2) for v in starts.values())
