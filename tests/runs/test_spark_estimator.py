"""Horovod's Spark estimator, ``horovod.spark.keras.KerasEstimator``, on PySpark 4 with the
Parquet data module (scripts/patches/python/horovod-0.28.1-spark-estimator.patch), under
Keras 3 and, in scripts/test.sh's Keras 2 pass (TF_USE_LEGACY_KERAS=1), Keras 2.

One local Spark session (local[2], no UI) for the module. The estimator trains a linear model
on 2 ranks (Horovod's own launch through Spark tasks and mpirun; the ranks inherit this
pytest's environment, its Keras included) and KerasModel.transform predicts every row. The
data module's exact sharding is checked on its own, with ranks 0 and 1 of 2 given by hand,
on Parquet files that Spark wrote.
"""

import os
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import keras_flavour
from spark_cluster import JAVA_OPTS

pytestmark = [pytest.mark.keras2, pytest.mark.timeout(600)]

ROWS = 300


def target(x1, x2):
    return 2.0 * x1 - 3.0 * x2 + 0.5


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    # The executors' Python is this venv's (Spark's default is the first python3 on PATH).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master("local[2]")
        .appName("hvdtrain-estimator")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.extraJavaOptions", JAVA_OPTS)  # the tests' clusters' settings
        .config("spark.driver.memory", "1g")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def frame(spark, rows):
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(rows, 2))
    df = spark.createDataFrame(
        [(i, float(a), float(b), float(target(a, b))) for i, (a, b) in enumerate(x)],
        ["id", "x1", "x2", "y"],
    )
    return VectorAssembler(inputCols=["x1", "x2"], outputCol="features").transform(df)


@pytest.fixture(scope="module")
def fitted(spark, tmp_path_factory):
    import tensorflow as tf
    from horovod.spark.common.store import Store
    from horovod.spark.keras import KerasEstimator

    keras = tf.keras
    inputs = keras.Input(shape=(2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    df = frame(spark, ROWS)
    estimator = KerasEstimator(
        num_proc=2,
        store=Store.create(str(tmp_path_factory.mktemp("store"))),
        model=model,
        optimizer=keras.optimizers.SGD(learning_rate=0.1),
        loss="mse",
        feature_cols=["features"],
        label_cols=["y"],
        validation=0.2,
        batch_size=16,
        epochs=4,
        random_seed=1,
        verbose=0,
    )
    return estimator, estimator.fit(df), df


def test_the_estimator_trains_on_two_ranks_and_the_model_predicts_every_row(fitted):
    estimator, keras_model, df = fitted
    from horovod.spark.keras.datamodule import ParquetDataModule

    assert estimator.getDataModule() is ParquetDataModule
    model = keras_model.getModel()
    assert type(model).__module__.split(".")[0] == keras_flavour()
    history = keras_model.getHistory()
    assert len(history["loss"]) == 4 and len(history["val_loss"]) == 4, history
    assert history["loss"][-1] < history["loss"][0] / 10, history
    assert history["val_loss"][-1] < 0.01, history
    # The ranks trained at 2 x 0.1 (Horovod's scaling); the model comes back at 0.1.
    assert float(np.asarray(model.optimizer.learning_rate)) == pytest.approx(0.1)
    w, b = model.layers[-1].get_weights()
    np.testing.assert_allclose(w.ravel(), [2.0, -3.0], atol=0.1)
    np.testing.assert_allclose(b, [0.5], atol=0.1)

    out = keras_model.transform(df).select("id", "x1", "x2", "y__output").toPandas()
    # The driver's tf.keras is still the Keras this process chose: under Keras 2 the estimator
    # once loaded Keras 3 as tf.keras (and every later tf.keras call of the driver ran on it).
    import tensorflow as tf

    assert tf.keras.Model.__module__.split(".")[0] == keras_flavour()
    assert len(out) == ROWS and sorted(out["id"]) == list(range(ROWS))
    assert out["y__output"].notna().all()
    error = np.abs(out["y__output"] - target(out["x1"], out["x2"]))
    assert error.max() < 0.15, error.max()


def shard_ids(data_module, path, passes):
    """The ids each pass gives this data module's rank, in order."""
    rows = pq.read_table(path).num_rows
    count = data_module.shard_count
    per_pass = (rows - data_module.cur_shard + count - 1) // count
    ids = [
        int(row["id"])
        for row in data_module.dataset(path, data_module.shuffle)
        .take(per_pass * passes)
        .as_numpy_iterator()
    ]
    return [ids[p * per_pass : (p + 1) * per_pass] for p in range(passes)]


def test_each_pass_the_ranks_together_see_every_row_exactly_once(spark, tmp_path):
    from horovod.spark.keras.datamodule import ParquetDataModule

    rows = 101  # 51 rows for rank 0, 50 for rank 1
    path = str(tmp_path / "train")
    from pyspark.ml.functions import vector_to_array

    # As the estimator writes its Store's files: vectors as arrays.
    (
        frame(spark, rows)
        .select("id", vector_to_array("features").alias("features"), "y")
        .repartition(3)
        .write.parquet(path)
    )
    assert len([f for f in os.listdir(path) if f.endswith(".parquet")]) == 3

    def module(rank, shuffle, seed=7):
        return ParquetDataModule(
            train_dir=path,
            val_dir=None,
            cur_shard=rank,
            shard_count=2,
            shuffle=shuffle,
            random_seed=seed,
            schema_fields=["id", "features", "y"],
        )

    # Unshuffled: rank r gets rows r::2 of the files in their sorted order, every pass.
    files = sorted(f for f in os.listdir(path) if f.endswith(".parquet"))
    order = [i for f in files for i in pq.read_table(os.path.join(path, f))["id"].to_pylist()]
    for rank in (0, 1):
        passes = shard_ids(module(rank, False), path, 2)
        assert passes == [order[rank::2]] * 2

    # Shuffled: each pass a new order, the same on both ranks, split exactly between them.
    rank0, rank1 = shard_ids(module(0, True), path, 3), shard_ids(module(1, True), path, 3)
    for mine, theirs in zip(rank0, rank1):
        assert (len(mine), len(theirs)) == (51, 50)
        assert sorted(mine + theirs) == list(range(rows))
    assert rank0[0] != rank0[1] != rank0[2] and rank0[0] != order[0::2]
    assert shard_ids(module(0, True), path, 3) == rank0  # the seed decides, nothing else
    assert shard_ids(module(0, True, seed=8), path, 1)[0] != rank0[0]

    # The rows' values come with them: a vector column as an array of its length.
    first = next(module(0, False).dataset(path, False).as_numpy_iterator())
    assert first["features"].shape == (2,)
    assert first["y"] == pytest.approx(target(*first["features"]))
