"""A real three-node Ray cluster on one machine, for tests/clusters/test_ray_cluster.py.

Ray as the "ray" extra pins it (`ray start`, the CLI a user runs on each machine), on three
hosts made by netns.Hosts: rayhead (10.76.0.1), raynode1 (10.76.0.2) and raynode2 (10.76.0.3),
network namespaces joined by a bridge, each with its own host name and /etc/hosts.

- rayhead runs `ray start --head --block` (the GCS on port 6379 of its address); each worker
  node runs `ray start --block --address 10.76.0.1:6379`, its node address its own. Every
  node declares 1 CPU and no GPU, with the smallest object store Ray accepts, no usage stats
  and no log monitor; the head has no dashboard and no autoscaler monitor (NODE_FLAGS and
  HEAD_FLAGS say what each saves). The cluster's environment is the test's clean one
  (``env``), with ``pythonpath`` (default: the checkout and tests/).
- The nodes share this machine's file system: each start of a node has its own
  ``--temp-dir`` (Ray's session, sockets and logs), TEMP/NODE-N under one short directory of
  /tmp (Ray's socket paths must fit AF_UNIX's 107 bytes; pytest's tmp dirs are too deep under
  xdist). Each node's `ray start` output is in base/NODE-N.out.
- A driver runs on the head (``driver_cmd``): ``ray.init()`` there connects to the cluster
  (RAY_ADDRESS is set; ``ray.init(address=cluster.address)`` is the same).
- ``remove_node`` kills a worker node the hard way (SIGKILL to every process of its
  namespace: a machine lost); ``add_node`` starts it again (a machine returning, a fresh
  ``--temp-dir``).

The ``ray start --block`` daemons are children of the test process; ``destroy`` sends them
SIGTERM (each stops what it started), kills what is left, deletes the namespaces and the
temporary directory, and checks that no process, namespace, mount or directory of the
cluster is left.
"""

import json
import os
import sys

import pytest

from conftest import ROOT, TESTS, TIME_SCALE, clean_env
from netns import Cluster, sh

NODES = {"rayhead": "10.76.0.1", "raynode1": "10.76.0.2", "raynode2": "10.76.0.3"}
HEAD = "rayhead"
IFACE = "hvdr0"  # each host's end of its veth to the bridge
PORT = 6379  # the GCS's, on the head's address (each host has its own ports)
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
OBJECT_STORE = 75 << 20  # Ray's smallest (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES)
# Every node: 1 CPU, no GPU, no usage stats, the smallest object store; no log monitor (a
# Python process per node that forwards the workers' output to the drivers: 230 MB of the
# cluster's 1.8 GB; the output stays in each node's logs, TEMP/NODE-N/session_*/logs/).
NODE_FLAGS = [
    "--num-cpus",
    "1",
    "--num-gpus",
    "0",
    "--disable-usage-stats",
    "--object-store-memory",
    str(OBJECT_STORE),
    "--include-log-monitor=false",
]
# The head: no dashboard, and no autoscaler monitor (80 MB more; `ray status` reads what it
# writes, and this cluster has no nodes to add). Ray's API server (job submission, the state
# API) and its Ray Client server still run there.
HEAD_FLAGS = ["--head", "--port", str(PORT), "--include-dashboard=false", "--no-monitor"]
# The GCS checks each node every second instead of every 3 (failing after 5 misses): a node
# lost is marked dead in about 5 s instead of 15.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_health_check_period_ms": "1000"}

# The states of the nodes Ray knows, {address: "ALIVE" | "DEAD"} (a node that returns on the
# same address is a new node: its latest registration counts), printed as JSON until WANT
# (the same shape, or {} for any) is seen or DEADLINE (seconds) passes; exit 1 then.
NODE_STATES = """
import json, sys, time
from ray._raylet import GcsClient
want, deadline = json.loads(sys.argv[2]), time.monotonic() + float(sys.argv[3])
gcs = GcsClient(address=sys.argv[1])
while True:
    states = {}
    for info in sorted(gcs.get_all_node_info(timeout=10).values(),
                       key=lambda i: i.start_time_ms):
        states[info.node_manager_address] = "ALIVE" if info.state == 0 else "DEAD"
    if states == want or not want or time.monotonic() > deadline:
        print(json.dumps(states), flush=True)
        sys.exit(0 if states == want or not want else 1)
    time.sleep(0.2)
"""


class RayCluster(Cluster):
    def __init__(self, base, pythonpath=(ROOT, TESTS)):
        super().__init__(
            base,
            NODES,
            HEAD,
            tag="hvdr",
            iface=IFACE,
            stop_seconds=30,
            env=clean_env(
                base / "home",
                PYTHONPATH=os.pathsep.join(pythonpath),
                TF_CPP_MIN_LOG_LEVEL="3",
                **RAY_ENV,
            ),
        )
        self.address = f"{NODES[HEAD]}:{PORT}"

    # --- making it ------------------------------------------------------------------------
    def create(self):
        if not os.access(RAY, os.X_OK):
            pytest.fail(f"{RAY} missing: pip install -c constraints.txt -e .[ray]")
        super().create(prefix="raycl-")
        for name in NODES:
            self.start_node(name)
            if name == HEAD:  # the workers register with its GCS
                self.wait_log(name, "Ray runtime started", 120)
        self.wait_nodes({ip: "ALIVE" for ip in NODES.values()}, 120)
        return self

    def start_node(self, name):
        temp = os.path.join(self.temp, f"{name}-{self.starts + 1}")
        flags = HEAD_FLAGS if name == HEAD else ["--address", self.address]
        return self.launch(
            name,
            [
                RAY,
                "start",
                "--block",
                *flags,
                "--node-ip-address",
                NODES[name],
                *NODE_FLAGS,
                "--temp-dir",
                temp,
            ],
        )

    # --- using it -------------------------------------------------------------------------
    def driver_cmd(self, cmd):
        """``cmd`` on the head: a Ray driver there connects with ``ray.init()``."""
        return self.on_node(HEAD, ["env", f"RAY_ADDRESS={self.address}", *cmd])

    def states(self, want=None, timeout=0):
        """{address: state} of the nodes Ray knows, as the GCS says; with ``want``, polled
        until it is that or ``timeout`` passes (then None)."""
        p = sh(
            *self.driver_cmd(
                [
                    sys.executable,
                    "-c",
                    NODE_STATES,
                    self.address,
                    json.dumps(want or {}),
                    str(timeout),
                ]
            ),
            timeout=timeout + 60 * TIME_SCALE,
        )
        if p.returncode not in (0, 1) or not p.stdout.strip():
            pytest.fail(f"reading the nodes from the GCS: rc {p.returncode}\n{p.stderr[-3000:]}")
        states = json.loads(p.stdout.strip().splitlines()[-1])
        return states if p.returncode == 0 else None

    def wait_nodes(self, want, timeout):
        """Until the GCS lists exactly ``want`` ({address: state}); fail with the logs."""
        timeout *= TIME_SCALE
        if self.states(want, timeout) is None:
            pytest.fail(
                f"RayCluster: not {want} within {timeout:.0f}s: {self.states()}\n{self.logs()}"
            )
