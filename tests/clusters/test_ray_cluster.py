"""A real three-node Ray cluster (tests/ray_cluster.py): three hosts in network namespaces,
`ray start` on each, a driver on the head.

The test proves the cluster is three machines to Ray: a placement group of three 1-CPU
bundles with STRICT_SPREAD (each bundle on a different node) places one task on each node,
and each task answers with its host's own name and address. Then a worker node is lost
(SIGKILL to all its processes): the GCS marks it dead; it comes back (`ray start` again) and
the cluster has three live nodes again.
"""
import json
import os
import sys

import pytest

from conftest import (LINEAR, ROOT, checkpoints, clean_env, finish, launch_example, rank_pids,
                      result, run, start, wait_for)
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


# --- hvdtrain.ray on the cluster ----------------------------------------------------------

MNIST = ["--batch-size", "50", "--epochs", "1", "--learning-rate", "0.5", "--no-download",
         "--verbose", "0"]
FIT = ["--model", "dense", "--epochs", "1", "--batch-size", "64"]


def hvdtrain_ray(cluster, *args):
    """``python -m hvdtrain.ray`` as a user runs it on the head (RAY_ADDRESS set there)."""
    return cluster.driver_cmd([sys.executable, "-m", "hvdtrain.ray", *map(str, args)])


def placed(err):
    """{rank: host} from the driver's line (the last attempt's)."""
    line = [l for l in err.splitlines() if l.startswith("hvdtrain.ray: 2 workers: ")][-1]
    return {int(p.split()[1]): p.split()[-1] for p in line.split(": ", 2)[2].split(", ")}


def test_a_task_and_a_fit_script_end_with_horovodruns_weights(ray_cluster, tmp_path,
                                                              references):
    """The built-in MNIST task and the hk.fit example, each on 2 workers that Ray places on
    two of the three hosts, end with the weights of the same job under horovodrun -np 2 on
    one machine (its digest in result.json)."""
    ref = references.run("gloo", 2, "mnist", *MNIST)
    p = run(hvdtrain_ray(ray_cluster, "--num-workers", 2, "mnist", *MNIST, "--run-dir",
                         tmp_path / "mnist"), ray_cluster.env, timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    hosts = placed(p.stderr)
    assert len(set(hosts.values())) == 2 and set(hosts.values()) <= set(NODES), hosts
    r = result(tmp_path / "mnist")
    assert (r["world_size"], r["ranks_identical"]) == (2, True)
    assert r["weights_sha256"] == ref["weights_sha256"]
    assert r["test_accuracy"] == ref["test_accuracy"]

    example = os.path.join(ROOT, "examples", "keras_fit_mnist.py")
    q = run(launch_example(2, "keras_fit_mnist.py", *FIT, "--run-dir", tmp_path / "fit_ref"),
            clean_env(tmp_path / "home"), timeout=240)
    assert q.returncode == 0, q.stderr[-3000:]
    p = run(hvdtrain_ray(ray_cluster, "--num-workers", 2, example, *FIT, "--run-dir",
                         tmp_path / "fit"), ray_cluster.env, timeout=240, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("Epoch 1/1") == 1  # rank 0's Keras lines, relayed once
    r, ref = result(tmp_path / "fit"), result(tmp_path / "fit_ref")
    assert (r["world_size"], r["ranks_identical"]) == (2, True)
    assert r["weights_sha256"] == ref["weights_sha256"]


def test_a_lost_node_restarts_the_job_on_the_others_to_the_same_weights(ray_cluster, tmp_path,
                                                                        references):
    """Mid-run, the node of a worker rank is lost (every process of that host SIGKILLed):
    the driver says so, Ray places the job again on the hosts left, and it resumes from its
    newest checkpoint to the weights of the uninterrupted job. The node then returns."""
    ref = references.run("gloo", 2, "linear", *LINEAR)
    run_dir = tmp_path / "run"
    proc = start(hvdtrain_ray(ray_cluster, "--num-workers", 2, "linear", *LINEAR, "--run-dir",
                              run_dir), ray_cluster.env, cwd=tmp_path)
    try:
        assert wait_for(lambda: checkpoints(run_dir), 120), "no checkpoint appeared"
        ranks = rank_pids(str(run_dir))
        assert sorted(ranks) == [0, 1], ranks
        lost = next(n for n in NODES if n != "rayhead"
                    and set(ranks.values()) & set(ray_cluster.pids(n)))
        ray_cluster.remove_node(lost)
        rc, out, err = finish(proc, 240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    try:
        assert rc == 0, err[-3000:]
        assert "the job starts again from its newest checkpoint (restart 1 of 3)" in err, err
        first, last = [l for l in err.splitlines() if l.startswith("hvdtrain.ray: 2 workers")]
        assert lost in first and lost not in last, (first, last)
        r = result(run_dir)
        assert r["weights_sha256"] == ref["weights_sha256"] and r["world_size"] == 2
    finally:
        ray_cluster.add_node(lost)
        ray_cluster.wait_nodes({ip: "ALIVE" for ip in NODES.values()}, 60)
