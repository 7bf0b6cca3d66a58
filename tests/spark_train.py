"""Training from a Spark DataFrame, for tests/runs/test_spark.py and the Spark cluster's
tests: the same hk.fit on the same arrays, either read from Parquet that
``hvdtrain.spark.write_parquet`` wrote from a DataFrame (``fit_from_parquet``, handed to
``hvdtrain.spark.run``), or loaded from an .npz file under horovodrun (``python
tests/spark_train.py NPZ RUN_DIR``). Exact sharding makes both end with the same weights.

A linear regression of 3 features (y = x . (1, -2, 0.5) + 0.3 + noise), 240 rows.
"""

import sys

ROWS, FEATURES, EPOCHS, BATCH = 240, 3, 3, 8


def rows():
    """The DataFrame's rows: (id, features, label), in their order."""
    import numpy as np

    rng = np.random.default_rng(11)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3 + rng.normal(0, 0.01, ROWS)
    return [(i, [float(v) for v in x[i]], float(y[i])) for i in range(ROWS)]


def fit_arrays(x, y, run_dir):
    """hk.fit of the linear model on (x, y); result.json's dict, with the data's sum."""
    import json
    import os

    import numpy as np

    import hvdtrain.keras as hk
    from hvdtrain.compat import keras

    k = keras()
    hk.init()
    k.utils.set_random_seed(0)
    model = k.Sequential([k.Input((FEATURES,)), k.layers.Dense(1)])
    model.compile(loss="mse", optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.05)))
    train = hk.dataset(x.astype("float32"), y.astype("float32"), BATCH, seed=0)
    hk.fit(model, train, EPOCHS, run_dir=run_dir, verbose=0)
    with open(os.path.join(run_dir, "result.json")) as f:
        result = json.load(f)
    return dict(result, data_sum=float(np.sum(x) + np.sum(y)), rows=len(y), size=hk.size())


def fit_from_parquet(path, run_dir):
    import hvdtrain.spark

    data = hvdtrain.spark.read_parquet(path, columns=["features", "label"])
    return fit_arrays(data["features"], data["label"], run_dir)


if __name__ == "__main__":
    import numpy as np

    arrays = np.load(sys.argv[1])
    fit_arrays(arrays["x"], arrays["y"], sys.argv[2])
