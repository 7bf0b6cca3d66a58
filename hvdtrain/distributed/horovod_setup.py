"""Horovod's import and the run-time defaults hvdtrain gives it (and Open MPI) where the
user has not; each process's device and thread pools. The one place hvdtrain imports horovod."""

from __future__ import annotations

import os
import sys

from hvdtrain.base.errors import error_line
from hvdtrain.base.launch import several_processes, usable_cores


def horovod_package():
    """The ``horovod`` package (its version, its files), for reports on the build."""
    import horovod

    return horovod


class TensorFlowMismatch(ImportError):
    """hvdtrain's Horovod wheel beside another TensorFlow than its build's; the message says
    both and the fix."""


def tensorflow_mismatch():
    """One line when hvdtrain's Horovod wheel was built against another TensorFlow than the
    installed one (its record, horovod/hvdtrain_built.json, names the build's), else None.
    Its op library would fail to load with an undefined symbol, which names neither."""
    import json
    from importlib import metadata
    from importlib.util import find_spec

    spec = find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(spec.submodule_search_locations[0], "hvdtrain_built.json")) as f:
            built = json.load(f)["tensorflow"]
        installed = metadata.version("tensorflow")
        horovod = metadata.version("horovod")
    except (OSError, ValueError, KeyError, TypeError, metadata.PackageNotFoundError):
        return None
    if built == installed:
        return None
    return (
        f"horovod {horovod} was built against TensorFlow {built}, but this environment "
        f"has TensorFlow {installed}: pip install tensorflow=={built} (the version the "
        f"wheel needs), or pip uninstall -y horovod && scripts/setup.sh (a build "
        f"against {installed})"
    )


def horovod_tensorflow():
    """``horovod.tensorflow``: fails if Horovod was built without TensorFlow or against
    another TensorFlow (named as that, where hvdtrain's wheel says which it was built for)."""
    mismatch = tensorflow_mismatch()
    if mismatch:
        raise TensorFlowMismatch(mismatch)
    import horovod.tensorflow as hvd

    return hvd


def horovod_keras():
    """``horovod.tensorflow.keras``: Horovod's own Keras 2 wrapper (the benchmarks' reference)."""
    import horovod.tensorflow.keras as hvd_keras

    return hvd_keras


def _import_horovod():
    """(horovod.tensorflow, None) or (None, reason)."""
    try:
        return horovod_tensorflow(), None
    except TensorFlowMismatch as e:  # its own one line, with the fix
        return None, str(e)
    except Exception as e:  # noqa: BLE001 (ImportError, or a TF op library of another TensorFlow)
        return None, error_line(e)


def _configure_devices(local_rank: int, local_size: int) -> None:
    """Pin one GPU per process and size CPU thread pools so local ranks share the cores."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        # Horovod: one GPU per process, chosen by local rank; memory growth so that a
        # process does not reserve the whole card up front.
        gpu = gpus[local_rank % len(gpus)]
        try:
            tf.config.set_visible_devices(gpu, "GPU")
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError as e:  # TensorFlow already initialised its devices
            print(
                f"hvdtrain: warning: cannot pin GPU {local_rank % len(gpus)} to local rank "
                f"{local_rank} ({e}): start hvdtrain before using TensorFlow",
                file=sys.stderr,
                flush=True,
            )
    if "TF_NUM_INTRAOP_THREADS" not in os.environ:
        # Two ranks on two cores each running a full-width pool oversubscribe the CPU.
        threads = max(1, usable_cores() // max(1, local_size))
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
        except RuntimeError:
            pass  # TensorFlow already ran (the caller used it first): its pools stay


# Horovod and Open MPI settings hvdtrain chooses when the user has not (measured on 2 cores,
# 2 ranks, in docs/performance/reproduce.md, "The knobs"). All are read once, at hvd.init().
HOROVOD_CYCLE_TIME_MS = "0.1"  # Horovod's default, 1 ms, is waited up to once per step
STALL_SHUTDOWN_SECONDS = "600"  # Horovod's default, 0, waits forever on a stalled rank
HOROVODRUN_BTL = "^openib"  # the transports horovodrun --mpi gives Open MPI (-mca btl)
ONE_HOST_BTL = "^openib,ofi"  # ... and on one host, without libfabric's (see below)


def _horovod_defaults(environ=os.environ) -> dict:
    """Set (where unset) and return the environment hvd.init() reads for speed and safety.

    HOROVOD_CYCLE_TIME: the background thread collects ready tensors once a cycle, so a step
    whose gradients are ready waits up to a cycle; with several ranks, 0.1 ms instead of 1 ms
    made the small softmax steps 2-6x faster on 2 processes and did not change the mlp's
    throughput measurably. A rank alone sends nothing per step, but a 0.1 ms cycle still
    wakes the thread 10,000 times a second: one process of the compute-bound mlp (batch 4096)
    ran 12 % slower than with 1 ms (docs/performance/speed.md), so one rank keeps Horovod's 1 ms.
    OMPI_MCA_mpi_yield_when_idle: when the local ranks take every core, a rank waiting in MPI
    must yield its core instead of spinning, or it steals it from a peer's compute (the mlp's
    2-process throughput doubled). Open MPI turns it on itself only when oversubscribed.
    HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: the watchdog ends the job when a rank dies or freezes
    (its heartbeat thread stops); a rank that lives but never reaches the next collective
    (stuck in user code, a hung read on one rank) keeps beating, and only Horovod's stall
    inspector sees it. It warns after HOROVOD_STALL_CHECK_TIME_SECONDS (Horovod's 60 s) and,
    by Horovod's default, waits forever; hvdtrain ends such a job after 10 minutes, longer
    than any legitimate gap between two collectives (rank 0's checkpoint write, evaluation).
    OMPI_MCA_btl: horovodrun --mpi runs mpirun with "-mca btl ^openib", which leaves Open
    MPI's libfabric transport (the ofi BTL) in; when every rank is on one host, shared memory
    carries all their traffic and that transport nothing, yet it took 0.5 s of each rank's
    MPI_Init and 1.0 s of its MPI_Finalize (at Horovod's shutdown) here. So on one host,
    and only for horovodrun's own value, it is left out too.
    """
    chosen = {}
    if "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" not in environ:
        chosen["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = STALL_SHUTDOWN_SECONDS
    if "HOROVOD_CYCLE_TIME" not in environ and several_processes(environ):
        chosen["HOROVOD_CYCLE_TIME"] = HOROVOD_CYCLE_TIME_MS
    local = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    if (
        local.isdigit()
        and int(local) >= usable_cores()
        and "OMPI_MCA_mpi_yield_when_idle" not in environ
    ):
        chosen["OMPI_MCA_mpi_yield_when_idle"] = "1"
    if (
        environ.get("OMPI_MCA_btl") == HOROVODRUN_BTL
        and local
        and local == environ.get("OMPI_COMM_WORLD_SIZE")
    ):
        chosen["OMPI_MCA_btl"] = ONE_HOST_BTL
    environ.update(chosen)
    return chosen
