"""A real two-node SLURM cluster on one machine, for tests/clusters/test_slurm.py.

Debian's SLURM 22.05 (slurmctld, slurmd, slurm-client, munge; scripts/setup.sh installs
them), run as root without systemd, every file under one test directory:

- one munged with its own key and socket (slurm.conf's ``AuthInfo=socket=``);
- two nodes, nodeA (10.78.0.1) and nodeB (10.78.0.2): each a network namespace joined to the
  other by a veth pair, with its own host name (a UTS namespace) and its own slurmd;
- slurmctld on nodeA, where the test also submits (sbatch, squeue, scancel run there).

Two details make it work: the daemons enter the namespaces with ``nsenter --net`` (``ip netns
exec`` remounts /sys, hiding /sys/fs/cgroup, and slurmd's cgroup plugin fails without it);
and each node reads its own copy of the configuration, whose mpi.conf gives it its own
``PMIxCliTmpDirBase``: the nodes share /tmp, and PMIx would give a job step's directory the
same name on both. ``AuthInfo=cred_expire=5`` makes a requeued job eligible again after 6 s
instead of 121, and the scheduler looks at pending jobs every second (instead of every 30 to
60 s), so a requeued job starts as soon as it may.

Every daemon is a child of the test process (run in the foreground); ``destroy`` kills them and
everything left in the namespaces, deletes the namespaces and checks that no process, namespace
or mount of the cluster is left.
"""

import os
import re
import shutil

import pytest

from netns import Hosts, sh

NODES = {"nodeA": "10.78.0.1", "nodeB": "10.78.0.2"}
IFACE = "hvds0"  # the veth's name in both namespaces
CPUS = 2  # per node, as slurm.conf declares them
DAEMONS = ("munged", "slurmctld", "slurmd")

SLURM_CONF = """ClusterName=hvdtrain
SlurmctldHost=nodeA({ctl})
AuthType=auth/munge
AuthInfo=socket={base}/munge/socket,cred_expire=5
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/ctld
SlurmctldPidFile={base}/ctld/pid
SlurmctldLogFile={base}/ctld/log
SlurmdSpoolDir={base}/%n/spool
SlurmdPidFile={base}/%n/pid
SlurmdLogFile={base}/%n/log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
SlurmdParameters=config_overrides
{nodes}
PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster(Hosts):
    def __init__(self, base):
        super().__init__(base, NODES, tag="hvds", iface=IFACE)
        self.conf = base / "ctld" / "slurm.conf"  # the clients' (the same text on every node)

    # --- making it ------------------------------------------------------------------------
    def create(self):
        missing = [
            d
            for d in DAEMONS + ("sbatch",)
            if shutil.which(d) is None and not os.access(f"/usr/sbin/{d}", os.X_OK)
        ]
        if missing:
            pytest.fail(
                f"SLURM missing ({', '.join(missing)}): apt-get install slurmctld slurmd "
                "slurm-client munge (scripts/setup.sh installs them)"
            )
        super().create()
        self.write_config()
        munge = self.base / "munge"
        self.start(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={munge}/socket",
                f"--key-file={munge}/key",
                f"--pid-file={munge}/pid",
                f"--log-file={munge}/log",
                f"--seed-file={munge}/seed",
            ],
        )
        self.wait(lambda: (munge / "socket").exists(), 10, "munged's socket")
        self.start("slurmctld", self.on_node("nodeA", ["slurmctld", "-D", "-i"], self.conf))
        for node in NODES:
            self.start(
                f"slurmd {node}",
                self.on_node(
                    node, ["slurmd", "-D", "-N", node], self.base / node / "conf" / "slurm.conf"
                ),
            )
        self.wait(
            lambda: self.client("sinfo", "-h", "-o", "%t").stdout.split() == ["idle"],
            30,
            "both nodes idle in sinfo",
        )
        return self

    def write_config(self):
        for d in ("munge", "ctld", *NODES):
            (self.base / d).mkdir()
        (self.base / "munge").chmod(0o700)
        key = self.base / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={ip} CPUs={CPUS} State=UNKNOWN" for n, ip in NODES.items()
        )
        text = SLURM_CONF.format(
            base=self.base, ctl=NODES["nodeA"], nodes=nodes, names=",".join(NODES)
        )
        self.conf.write_text(text)
        for node in NODES:
            conf = self.base / node / "conf"
            conf.mkdir(parents=True)
            (conf / "slurm.conf").write_text(text)
            (self.base / node / "pmix").mkdir()
            (conf / "mpi.conf").write_text(f"PMIxCliTmpDirBase={self.base / node / 'pmix'}\n")

    def on_node(self, node, cmd, conf):
        """``cmd`` as run on ``node``: its network namespace (nsenter, which keeps /sys as it
        is), its host name, its configuration."""
        return self.on(node, cmd, nsenter=True, env=[f"SLURM_CONF={conf}"])

    # --- using it -------------------------------------------------------------------------
    def env(self, env):
        """``env`` for a SLURM client: this cluster's configuration, no outer job's variables."""
        env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def client_cmd(self, *cmd):
        """A SLURM command as run on nodeA, the submit node."""
        return ["nsenter", f"--net=/run/netns/{self.ns['nodeA']}", *cmd]

    def client(self, *cmd, env=None, cwd=None, timeout=30):
        return sh(
            *self.client_cmd(*cmd), env=self.env(env or dict(os.environ)), cwd=cwd, timeout=timeout
        )

    def job(self, job_id):
        """``scontrol show job`` as a dict (JobState, ExitCode, Reason, Restarts, ...)."""
        out = self.client("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))
