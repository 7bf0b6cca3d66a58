"""A real three-node Ray cluster (tests/ray_cluster.py): three hosts in network namespaces,
`ray start` on each, a driver on the head.

The test proves the cluster is three machines to Ray: a placement group of three 1-CPU
bundles with STRICT_SPREAD (each bundle on a different node) places one task on each node,
and each task answers with its host's own name and address. Then a worker node is lost
(SIGKILL to all its processes): the GCS marks it dead; it comes back (`ray start` again) and
the cluster has three live nodes again.
"""
import json
import sys

import pytest

from conftest import run
from ray_cluster import NODES, RayCluster

# The bound covers the module's fixture: three nodes started, then stopped.
pytestmark = pytest.mark.timeout(300)

# One task per bundle of a STRICT_SPREAD placement group: [(host name, node address)].
SPREAD = """
import json, socket, ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init(log_to_driver=False)
pg = placement_group([{"CPU": 1}] * 3, strategy="STRICT_SPREAD")
ray.get(pg.ready(), timeout=60)

@ray.remote(num_cpus=1)
def where():
    return socket.gethostname(), ray.util.get_node_ip_address()

print(json.dumps(ray.get([where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
    placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(3)],
    timeout=60)))
"""


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    cluster = RayCluster(tmp_path_factory.mktemp("raycluster"))
    try:
        yield cluster.create()
    finally:
        cluster.destroy()  # and checks that no process, namespace, mount or dir is left


def spread(cluster):
    """Where the three tasks of a STRICT_SPREAD placement group ran: [(host, address)]."""
    p = run(cluster.driver_cmd([sys.executable, "-c", SPREAD]), cluster.env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return sorted(map(tuple, json.loads(p.stdout.strip().splitlines()[-1])))


def test_three_nodes_one_task_each_then_a_node_lost_and_back(ray_cluster):
    assert spread(ray_cluster) == sorted(NODES.items())

    ray_cluster.remove_node("raynode2")
    # Lost: the GCS marks it dead (its health checks fail), the two others stay alive.
    ray_cluster.wait_nodes({ip: "DEAD" if name == "raynode2" else "ALIVE"
                            for name, ip in NODES.items()}, 30)
    ray_cluster.add_node("raynode2")
    # Back: a new node on the same address (its old registration stays dead, the newest one
    # counts), and work placed on it again.
    ray_cluster.wait_nodes({ip: "ALIVE" for ip in NODES.values()}, 60)
    assert spread(ray_cluster) == sorted(NODES.items())
