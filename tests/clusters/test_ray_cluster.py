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
import re
import sys

import pytest

from conftest import (
    LINEAR,
    as_printed,
    checkout_like,
    clean_env,
    finish,
    launch_example,
    lose_after_first_checkpoint,
    rank_pids,
    result,
    run,
    start,
    wait_for,
)
from docs_pages import block
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
    ray_cluster.wait_nodes(
        {ip: "DEAD" if name == "raynode2" else "ALIVE" for name, ip in NODES.items()}, 30
    )
    ray_cluster.add_node("raynode2")
    # Back: a new node on the same address (its old registration stays dead, the newest one
    # counts), and work placed on it again.
    ray_cluster.wait_nodes({ip: "ALIVE" for ip in NODES.values()}, 60)
    assert spread(ray_cluster) == sorted(NODES.items())


# --- hvdtrain.ray on the cluster ----------------------------------------------------------

MNIST = [
    "--batch-size",
    "50",
    "--epochs",
    "1",
    "--learning-rate",
    "0.5",
    "--no-download",
    "--verbose",
    "0",
]
FIT = ["--model", "dense", "--epochs", "1", "--batch-size", "64"]


def hvdtrain_ray(cluster, *args):
    """``python -m hvdtrain.ray`` as a user runs it on the head (RAY_ADDRESS set there)."""
    return cluster.driver_cmd([sys.executable, "-m", "hvdtrain.ray", *map(str, args)])


def placed(err):
    """{rank: host} from the driver's line (the last attempt's)."""
    line = [l for l in err.splitlines() if l.startswith("hvdtrain.ray: 2 workers: ")][-1]
    return {int(p.split()[1]): p.split()[-1] for p in line.split(": ", 2)[2].split(", ")}


def test_a_task_and_a_fit_script_end_with_horovodruns_weights(ray_cluster, tmp_path, references):
    """The built-in MNIST task and the hk.fit example, each on 2 workers that Ray places on
    two of the three hosts, end with the weights of the same job under horovodrun -np 2 on
    one machine (its digest in result.json)."""
    ref = references.run("gloo", 2, "mnist", *MNIST)
    p = run(
        hvdtrain_ray(
            ray_cluster, "--num-workers", 2, "mnist", *MNIST, "--run-dir", tmp_path / "mnist"
        ),
        ray_cluster.env,
        timeout=240,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    hosts = placed(p.stderr)
    assert len(set(hosts.values())) == 2 and set(hosts.values()) <= set(NODES), hosts
    r = result(tmp_path / "mnist")
    assert (r["world_size"], r["ranks_identical"]) == (2, True)
    assert r["weights_sha256"] == ref["weights_sha256"]
    assert r["test_accuracy"] == ref["test_accuracy"]

    # The page's fit-script command, as printed (in a directory like the checkout).
    (line,) = block(
        "guides/clusters/ray.md", "python -m hvdtrain.ray --num-workers 2 examples/"
    ).commands()
    args = as_printed(line)[5:]  # examples/keras_fit_mnist.py and its flags
    assert args[0] == "examples/keras_fit_mnist.py"
    ref_dir = tmp_path / "fit_ref"
    q = run(
        launch_example(
            2, "keras_fit_mnist.py", *args[1 : args.index("--run-dir")], "--run-dir", ref_dir
        ),
        clean_env(tmp_path / "home"),
        timeout=240,
    )
    assert q.returncode == 0, q.stderr[-3000:]
    cwd = checkout_like(tmp_path / "checkout")
    p = run(ray_cluster.driver_cmd(as_printed(line)), ray_cluster.env, timeout=240, cwd=cwd)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("Epoch 1/1") == 1  # rank 0's Keras lines, relayed once
    r, ref = result(cwd / "runs" / "fit"), result(ref_dir)
    assert (r["world_size"], r["ranks_identical"]) == (2, True)
    assert r["weights_sha256"] == ref["weights_sha256"]


def test_the_pages_cluster_and_mnist_commands_as_printed(ray_cluster, tmp_path):
    """The page's `ray start` lines are the cluster's (its own flags added); its MNIST command
    and its Python call, run as printed on the head, train the same job: the same weights,
    the accuracy the call printed, the first lines the page shows."""
    head, *others = block("guides/clusters/ray.md", "ray start --head").commands()
    assert len(others) == 1
    for line, node in ((head, "rayhead"), (others[0], "raynode1")):
        words = as_printed(line.replace("HEAD", NODES["rayhead"]))
        cmd = [os.path.basename(ray_cluster.commands[node][0]), *ray_cluster.commands[node][1:]]
        assert (
            all(w in cmd for w in words)
            and cmd[cmd.index("--address" if node != "rayhead" else "--port") + 1] == words[-1]
        )
    cwd = checkout_like(tmp_path / "checkout")
    (line,) = block(
        "guides/clusters/ray.md", "python -m hvdtrain.ray --num-workers 2 mnist"
    ).commands()
    p = run(ray_cluster.driver_cmd(as_printed(line)), ray_cluster.env, timeout=240, cwd=cwd)
    assert p.returncode == 0, p.stderr[-3000:]
    shown = block("guides/clusters/ray.md", "hvdtrain.ray: 2 workers:").text.splitlines()
    said = [
        l
        for l in (p.stderr + "\n" + p.stdout).splitlines()
        if l.startswith(("hvdtrain.ray:", "hvdtrain: mnist"))
    ]
    assert re.fullmatch(shown[0].replace("node1", r"(\w+)").replace("node2", r"(\w+)"), said[0]), (
        said
    )
    assert said[1].startswith(shown[1].rstrip(".").rstrip(", ")), said
    r = result(cwd / "runs" / "ray")
    assert (r["world_size"], r["epochs"]) == (2, 1) and 0.5 < r["test_accuracy"] <= 1.0

    code = block("guides/clusters/ray.md", "import hvdtrain.ray").text
    p = run(
        ray_cluster.driver_cmd([sys.executable, "-c", code]), ray_cluster.env, timeout=240, cwd=cwd
    )
    assert p.returncode == 0, p.stderr[-3000:]
    py = result(cwd / "runs" / "ray-py")
    assert p.stdout.strip().splitlines()[-1] == str(py["test_accuracy"])
    assert py["weights_sha256"] == r["weights_sha256"]


def test_a_lost_node_restarts_the_job_on_the_others_to_the_same_weights(
    ray_cluster, tmp_path, references
):
    """Mid-run, the node of a worker rank is lost (every process of that host SIGKILLed):
    the driver says so, Ray places the job again on the hosts left, and it resumes from its
    newest checkpoint to the weights of the uninterrupted job. The node then returns."""
    ref = references.run("gloo", 2, "linear", *LINEAR)
    run_dir = tmp_path / "run"
    lost = []

    def lose_node(ranks):  # a worker node holding a rank
        lost.append(
            next(
                n
                for n in NODES
                if n != "rayhead" and set(ranks.values()) & set(ray_cluster.pids(n))
            )
        )
        ray_cluster.remove_node(lost[0])

    rc, out, err = lose_after_first_checkpoint(
        hvdtrain_ray(ray_cluster, "--num-workers", 2, "linear", *LINEAR, "--run-dir", run_dir),
        ray_cluster.env,
        run_dir,
        lose_node,
        240,
        cwd=tmp_path,
    )
    (lost,) = lost
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


def test_elastic_a_lost_node_leaves_the_others_going_and_it_joins_again(ray_cluster, tmp_path):
    """An elastic job (--min-workers 1 --max-workers 3) grows to the three hosts; one worker
    host is lost mid-run: the two others go on from their last commit, on the same weights;
    the host returns and joins. The job ends with three ranks on the same weights, every epoch
    logged once."""
    run_dir = tmp_path / "elastic"
    # Long enough for the host's loss and return: here three ranks from epoch 1, the loss seen
    # by epoch 2, the host back by epoch 16 (2 s an epoch); 36 leaves 20 epochs to spare.
    epochs = 36
    # The survivors notice a lost host at their next collective's time-out, Gloo's: 10 s
    # here instead of 30 (the driver hands its HOROVOD_ variables to the ranks).
    cmd = hvdtrain_ray(
        ray_cluster,
        "--min-workers",
        1,
        "--max-workers",
        3,
        "linear",
        "--batch-size",
        1,
        "--epochs",
        epochs,
        "--learning-rate",
        "0.0005",
        "--commit-every",
        20,
        "--run-dir",
        run_dir,
    )
    cmd.insert(
        cmd.index(f"RAY_ADDRESS={ray_cluster.address}") + 1, "HOROVOD_GLOO_TIMEOUT_SECONDS=10"
    )
    proc = start(cmd, ray_cluster.env, cwd=tmp_path)

    def sizes():
        try:
            return [json.loads(l)["world_size"] for l in open(run_dir / "metrics.jsonl")]
        except (OSError, ValueError):
            return []

    try:
        assert wait_for(lambda: sizes()[-1:] == [3], 120), ("never three ranks", sizes())
        ranks = rank_pids(str(run_dir))
        lost = next(
            n for n in NODES if n != "rayhead" and set(ranks.values()) & set(ray_cluster.pids(n))
        )
        ray_cluster.remove_node(lost)
        assert wait_for(lambda: sizes()[-1:] == [2], 120), ("never two ranks", sizes())
        ray_cluster.add_node(lost)
        rc, out, err = finish(proc, 400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    s = sizes()
    assert rc == 0, (s, err[-3000:])
    r = result(run_dir)
    assert (r["world_size"], r["ranks_identical"], r["epochs"]) == (3, True, epochs), (s, err)
    assert len(s) == epochs and 2 in s and s[-1] == 3, (s, err[-3000:])
    # The others went on (each change a reset from the last commit), never a restart.
    assert "restart" not in err and "hvdtrain: resumed at epoch" in err, err[-3000:]
