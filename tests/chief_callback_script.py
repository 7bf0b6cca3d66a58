"""hk.fit with a chief-only callback (``hk.on_chief``) that fails on rank 0 at the end of
epoch 2: ``raise`` raises, ``block`` never returns (a tracker's server that hangs), bounded by
``hk.on_chief(..., timeout=3)``.

    horovodrun -np 2 python tests/chief_callback_script.py raise|block RUN_DIR
"""
import sys
import time

import numpy as np

import hvdtrain.keras as hk
from hvdtrain.compat import keras

mode, run_dir = sys.argv[1], sys.argv[2]
k = keras()


class Tracker(k.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"chief callback: epoch {epoch + 1} loss {logs['loss']:.6f} on rank {hk.rank()}",
              flush=True)
        if epoch == 1 and mode == "raise":
            raise RuntimeError("the tracker's server answered 503")
        if epoch == 1 and mode == "block":
            time.sleep(3600)


hk.init()
x = np.random.RandomState(0).rand(512, 8).astype("float32")
y = (x.sum(axis=1) > 4).astype("int64")
model = k.Sequential([k.Input((8,)), k.layers.Dense(2, activation="softmax")])
model.compile(optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)),
              loss="sparse_categorical_crossentropy", jit_compile=False)
try:
    hk.fit(model, hk.dataset(x, y, 32), epochs=4, run_dir=run_dir, verbose=0,
           callbacks=[hk.on_chief(Tracker(), timeout=3)])
except hk.Error as e:
    sys.exit(hk.report_error(e))
