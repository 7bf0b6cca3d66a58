"""A plain Horovod Keras script (nothing of hvdtrain imported) that logs with the trackers'
one-line integrations on every rank, without ``if hvd.rank() == 0``: MLflow's autologging and
``wandb.init()``. On hvdtrain's Horovod it makes one MLflow run and one W&B run per job.

    MLFLOW_TRACKING_URI=http://127.0.0.1:5000 WANDB_MODE=offline \
        horovodrun -np 2 python examples/horovod_keras_autolog.py
"""
import os

import horovod.tensorflow.keras as hvd
import mlflow
import mlflow.tensorflow
import numpy as np
import wandb

if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    import tf_keras as keras
else:
    import keras

hvd.init()
mlflow.tensorflow.autolog()
run = wandb.init(project="plain-horovod")

x = np.random.RandomState(0).rand(256, 8).astype("float32")
y = (x.sum(axis=1) > 4).astype("int64")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation="softmax")])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1 * hvd.size())),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit(x, y, batch_size=32, epochs=2, verbose=0,
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
run.log({"final_loss": history.history["loss"][-1]})
run.finish()
