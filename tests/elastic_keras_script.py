"""Horovod's elastic Keras fit, as Horovod's examples/elastic/tensorflow2/
tensorflow2_keras_mnist_elastic.py writes it (a warm-up step, KerasState, its three callbacks,
``@hvd.elastic.run``), on tiny data, with a worker that dies mid-epoch:

    HVDTRAIN_HOSTS_FILE=hosts horovodrun -np 2 --min-np 1 --max-np 2 \\
        --host-discovery-script scripts/discover_hosts.sh --network-interface lo \\
        python tests/elastic_keras_script.py LOG MARKER

The process that starts as rank 1 SIGKILLs itself in epoch 1 before batch 5 (once: it
leaves MARKER). While the job has one worker, rank 0 waits at each epoch's end (at most 120
s) for the driver to announce a host, which tests/faults/test_elastic.py adds to the hosts file.
Every process appends JSON lines to LOG: each commit (the weights it commits), each reset
(the weights restored), each start of ``train`` (the weights synced), and the end.
Nothing of hvdtrain is imported.
"""

import json
import os
import signal
import sys
import time

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

LOG, MARKER = sys.argv[1], sys.argv[2]
EPOCHS, STEPS, COMMIT_EVERY = 6, 8, 2
KILL_AT = (1, 5)  # (epoch, batch): mid-epoch, one batch after a commit

hvd.init()
START_RANK = int(os.environ.get("HOROVOD_RANK", hvd.rank()))

rng = np.random.default_rng(START_RANK)
x = rng.normal(size=(64, 4)).astype("float32")
y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.1).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8)

tf.keras.utils.set_random_seed(1 + START_RANK)  # other initial weights: the sync must show
model = tf.keras.Sequential([tf.keras.Input(shape=(4,)), tf.keras.layers.Dense(1)])
# Horovod: scale the learning rate by the workers; momentum: slots the state carries too.
opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9))
model.compile(loss="mse", optimizer=opt)
# Horovod: one step builds the optimizer's variables, so that every worker syncs as many.
model.fit(dataset, steps_per_epoch=1, epochs=1, verbose=0)

state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def log(event, **extra):
    weights = np.concatenate([w.ravel() for w in state.model.get_weights()]).tolist()
    line = dict(
        event=event,
        pid=os.getpid(),
        start_rank=START_RANK,
        rank=hvd.rank(),
        size=hvd.size(),
        epoch=state.epoch,
        batch=state.batch,
        weights=weights,
        **extra,
    )
    with open(LOG, "a") as f:
        f.write(json.dumps(line) + "\n")


def on_state_reset():
    # Horovod: the learning rate follows the number of workers (`learning_rate`: both Keras).
    state.model.optimizer.learning_rate.assign(0.01 * hvd.size())
    log("reset")  # after a failure: the weights just restored from the last commit
    # Horovod: one step to meet the workers that join (they take theirs before syncing).
    state.model.fit(dataset, steps_per_epoch=1, epochs=1, verbose=0)


state.register_reset_callbacks([on_state_reset])


class Faults(tf.keras.callbacks.Callback):
    """The failure and the wait for the host the test adds."""

    def on_batch_begin(self, batch, logs=None):
        if START_RANK == 1 and (state.epoch, batch) == KILL_AT and not os.path.exists(MARKER):
            open(MARKER, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_end(self, epoch, logs=None):
        # Alone: wait until the driver announces a host (Horovod's own elastic tests read
        # the same queue), so that the job does not end before one joins. The commit that
        # follows (CommitStateCallback) then stops this fit to take the new worker in.
        deadline = time.monotonic() + 120
        while hvd.size() == 1 and state._host_messages.empty() and time.monotonic() < deadline:
            time.sleep(0.1)


class LoggedCommit(hvd.elastic.CommitStateCallback):
    def commit(self):
        log("commit")
        super().commit()


callbacks = [
    Faults(),
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    LoggedCommit(state, batches_per_commit=COMMIT_EVERY),
]


@hvd.elastic.run
def train(state):
    log("train")  # synced: rank 0's weights on every worker
    state.model.fit(
        dataset, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch, callbacks=callbacks, verbose=0
    )


train(state)
log("end")
