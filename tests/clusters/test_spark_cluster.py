"""A real standalone Spark cluster (tests/spark_cluster.py): a Master on sparkhead and a
Worker on each of sparknode1 and sparknode2, three hosts in network namespaces, a PySpark
driver on the head.

Horovod's own ``horovod.spark.run`` runs across the two hosts, with Gloo and with MPI: one
rank on each host, an allreduce that sums over both. ``python -m hvdtrain.spark`` as the
Spark page prints it trains MNIST with one rank on each worker to the weights of the same job
under horovodrun; an executor killed mid-epoch (its JVM and everything under it SIGKILLed,
the Worker left) restarts the job, which ends with the uninterrupted weights. Horovod's
KerasEstimator fits on a DataFrame with a rank on each worker and predicts every row. A lost
Worker leaves the Master at once and registers again when it returns.

Measured with the executor-loss probe this module used to run: ``horovod.spark.run`` raises
a RuntimeError 3 to 5 s after the kill with Gloo ("exited with non-zero status", the lost
rank's exit code None), 1.4 to 1.8 s with MPI ("mpirun failed with exit code 205"); the
Master gives the application a new executor on the same Worker at once.

The module takes about 2.5 minutes on 2 cores: the cluster's start (10 to 15 s), a driver's
JVM and two ranks importing TensorFlow for each run.
"""

import json
import os
import re
import sys
import time

import pytest

from conftest import LINEAR, as_printed, checkout_like, lose_after_first_checkpoint, result, run
from docs_pages import block
from spark_cluster import NODES, SparkCluster

# The bound covers the module's fixture: the cluster started, then stopped.
pytestmark = pytest.mark.timeout(400)

# A driver on the head: horovod.spark.run with Gloo, then with MPI; each rank answers
# [rank, size, host name, the sum over the ranks of rank + 1]; one JSON line per run.
RUN = """
import json, sys


def where():
    import socket
    import tensorflow as tf
    import horovod.tensorflow as hvd
    hvd.init()
    total = hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)
    return hvd.rank(), hvd.size(), socket.gethostname(), float(total.numpy())


if __name__ == "__main__":  # horovod.spark.run starts processes of its own
    import horovod.spark
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master(sys.argv[1]).getOrCreate()
    for mpi in sys.argv[2:]:
        answers = horovod.spark.run(where, num_proc=2, use_mpi=mpi == "mpi",
                                    use_gloo=mpi == "gloo", start_timeout=120)
        print("ANSWERS " + json.dumps({mpi: answers}), flush=True)
    spark.stop()
"""


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory):
    cluster = SparkCluster(tmp_path_factory.mktemp("sparkcluster"))
    try:
        yield cluster.create()
    finally:
        cluster.destroy()  # and checks that no process, namespace, mount or dir is left


def driver(cluster, tmp_path, *args):
    script = tmp_path / "driver.py"
    script.write_text(RUN)
    return cluster.driver_cmd([sys.executable, str(script), cluster.master, *map(str, args)])


def test_horovod_spark_run_puts_one_rank_on_each_host_with_gloo_and_mpi(spark_cluster, tmp_path):
    p = run(
        driver(spark_cluster, tmp_path, "gloo", "mpi"), spark_cluster.env, timeout=300, cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr[-3000:]
    runs = {}
    for line in p.stdout.splitlines():
        if line.startswith("ANSWERS "):
            runs.update(json.loads(line[len("ANSWERS ") :]))
    assert set(runs) == {"gloo", "mpi"}, p.stdout[-3000:]
    for answers in runs.values():
        assert sorted(a[0] for a in answers) == [0, 1], runs
        assert {a[1] for a in answers} == {2}, runs
        assert sorted(a[2] for a in answers) == ["sparknode1", "sparknode2"], runs
        assert {a[3] for a in answers} == {3.0}, runs  # (0 + 1) + (1 + 1)


# A driver with the cluster's defaults only (no .master(...)): the host names of 8 tasks.
HOSTS = """
import json, socket
from pyspark.sql import SparkSession

spark = SparkSession.builder.getOrCreate()
print(json.dumps(sorted(set(spark.sparkContext.parallelize(range(8), 8)
                            .map(lambda _: socket.gethostname()).collect()))))
spark.stop()
"""


def test_a_lost_worker_leaves_the_master_at_once_and_registers_again(spark_cluster):
    """A node lost whole (its Worker and all under it SIGKILLed): the Master drops the Worker
    as its connection closes (no 60 s heartbeat time-out); started again, it registers, and a
    driver that sets nothing but the defaults runs tasks on both hosts."""
    lost_at = time.monotonic()
    spark_cluster.remove_node("sparknode2")
    spark_cluster.wait_workers(1, 20)
    dropped = time.monotonic() - lost_at
    assert [w["host"] for w in spark_cluster.workers() if w["state"] == "ALIVE"] == [
        NODES["sparknode1"]
    ]
    spark_cluster.add_node("sparknode2")
    spark_cluster.wait_workers(2, 60)
    print({"dropped_after_s": round(dropped, 1)})
    p = run(spark_cluster.driver_cmd([sys.executable, "-c", HOSTS]), spark_cluster.env, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == ["sparknode1", "sparknode2"]


# --- hvdtrain.spark on the cluster --------------------------------------------------------


def placed(text):
    """{rank: host} from the driver's "hvdtrain.spark: N ranks: rank 0 on H, ..." line."""
    line = next(
        l for l in text.splitlines() if l.startswith("hvdtrain.spark: ") and " ranks: " in l
    )
    return {int(r): h for r, h in re.findall(r"rank (\d+) on (\S+?)(?:,|$)", line)}


def test_the_pages_commands_train_mnist_to_horovodruns_weights_one_rank_per_host(
    spark_cluster, tmp_path, references
):
    """The page's spark-class lines are the cluster's daemons (its own flags added); its MNIST
    command, run as printed on the head, places one rank on each worker, shows the lines the
    page shows and ends with the weights of the same job under horovodrun -np 2."""
    lines = block(
        "guides/clusters/spark.md", "spark-class org.apache.spark.deploy.master"
    ).commands()
    assert len(lines) == 2
    for line, node in zip(lines, ("sparkhead", "sparknode1")):
        words = as_printed(line.replace("HEAD", NODES["sparkhead"]))
        cmd = [os.path.basename(spark_cluster.commands[node][0]), *spark_cluster.commands[node][1:]]
        assert all(w in cmd for w in words), (words, cmd)
    ref = references.run("gloo", 2, "mnist", "--epochs", "1")
    cwd = checkout_like(tmp_path / "checkout")
    (line,) = block(
        "guides/clusters/spark.md", "python -m hvdtrain.spark --master spark://HEAD"
    ).commands()
    p = run(
        spark_cluster.driver_cmd(as_printed(line.replace("HEAD", NODES["sparkhead"]))),
        spark_cluster.env,
        timeout=300,
        cwd=cwd,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    hosts = placed(p.stderr)
    assert sorted(hosts) == [0, 1] and sorted(hosts.values()) == ["sparknode1", "sparknode2"]
    shown = block("guides/clusters/spark.md", "hvdtrain.spark: 2 ranks:").text.splitlines()
    said = [
        l
        for l in (p.stderr + "\n" + p.stdout).splitlines()
        if l.startswith(("hvdtrain.spark:", "[0]<stdout>:hvdtrain: mnist"))
    ]
    assert re.fullmatch(shown[0].replace("node1", r"(\w+)").replace("node2", r"(\w+)"), said[0]), (
        said
    )
    assert len(said) > 1 and said[1].startswith(shown[1].rstrip(".").rstrip(", ")), (
        said,
        p.stdout[-3000:],
        p.stderr[-3000:],
    )
    r = result(cwd / "runs" / "spark")
    assert (r["world_size"], r["epochs"], r["ranks_identical"]) == (2, 1, True)
    assert r["weights_sha256"] == ref["weights_sha256"]
    assert r["test_accuracy"] == ref["test_accuracy"]


def test_an_executor_killed_mid_epoch_restarts_the_job_to_the_uninterrupted_weights(
    spark_cluster, tmp_path, references
):
    """The linear task on the two workers; rank 1's executor (its JVM, the Python workers and
    the rank under them) SIGKILLed after the first checkpoint, mid-epoch: the driver says so
    in one line, Spark gives the application a new executor on that worker, and the job,
    started again from its newest checkpoint, ends with the weights of the same job under
    horovodrun, uninterrupted."""
    ref = references.run("gloo", 2, "linear", *LINEAR)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "hvdtrain.spark",
        "--num-proc",
        "2",
        "linear",
        *LINEAR,
        "--run-dir",
        str(run_dir),
    ]

    def lose_executor(pids):  # rank 1's host's
        host = next(h for h in ("sparknode1", "sparknode2") if pids[1] in spark_cluster.pids(h))
        killed = spark_cluster.kill_executor(host)
        assert pids[1] in killed, (pids, killed)

    rc, out, err = lose_after_first_checkpoint(
        spark_cluster.driver_cmd(cmd), spark_cluster.env, run_dir, lose_executor, 300, first=180
    )
    assert rc == 0, err[-3000:]
    said = [l for l in err.splitlines() if l.startswith("hvdtrain.spark: ") and "restart" in l]
    assert said == [
        "hvdtrain.spark: rank 1's process ended before its rank did (its Spark "
        "task, executor or machine lost): the job starts again from its newest "
        "checkpoint (restart 1 of 3)"
    ], err[-3000:]
    assert "resumed from" in out + err, err[-3000:]
    again = placed(err.split(said[0])[1])
    assert sorted(again.values()) == ["sparknode1", "sparknode2"], err[-3000:]
    r = result(run_dir)
    assert (r["world_size"], r["global_step"]) == (2, ref["global_step"]), err[-3000:]
    assert r["weights_sha256"] == ref["weights_sha256"], err[-3000:]


# A driver on the head: Horovod's KerasEstimator fits a linear model on a DataFrame on the two
# workers (a rank on each: one core each) with its store on storage both see, then its model
# predicts every row of the DataFrame. One JSON line.
ESTIMATOR = """
import json, sys

import numpy as np
import tensorflow as tf
from horovod.spark.common.store import Store
from horovod.spark.keras import KerasEstimator
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import SparkSession

if __name__ == "__main__":
    spark = SparkSession.builder.getOrCreate()
    x = np.random.default_rng(0).uniform(-1, 1, size=(200, 2))
    df = spark.createDataFrame([(i, float(a), float(b), float(2 * a - 3 * b + 0.5))
                                for i, (a, b) in enumerate(x)], ["id", "x1", "x2", "y"])
    df = VectorAssembler(inputCols=["x1", "x2"], outputCol="features").transform(df)
    keras = tf.keras
    inputs = keras.Input(shape=(2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    estimator = KerasEstimator(
        num_proc=2, store=Store.create(sys.argv[1]), model=model, loss="mse",
        optimizer=keras.optimizers.SGD(learning_rate=0.1), feature_cols=["features"],
        label_cols=["y"], batch_size=16, epochs=4, random_seed=1, verbose=0)
    fitted = estimator.fit(df)
    out = fitted.transform(df).select("id", "y", "y__output").toPandas()
    print("RESULT " + json.dumps({
        "ids": sorted(int(i) for i in out["id"]), "nulls": int(out["y__output"].isna().sum()),
        "max_error": float((out["y"] - out["y__output"]).abs().max()),
        "loss": [float(v) for v in fitted.getHistory()["loss"]]}), flush=True)
    spark.stop()
"""


def test_horovods_keras_estimator_fits_on_the_two_workers_and_predicts_every_row(
    spark_cluster, tmp_path
):
    script = tmp_path / "estimator.py"
    script.write_text(ESTIMATOR)
    p = run(
        spark_cluster.driver_cmd([sys.executable, str(script), str(tmp_path / "store")]),
        spark_cluster.env,
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert got["ids"] == list(range(200)) and got["nulls"] == 0, got
    assert len(got["loss"]) == 4 and got["loss"][-1] < got["loss"][0] / 10, got["loss"]
    assert got["max_error"] < 0.2, got
