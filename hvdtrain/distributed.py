"""Everything rank-dependent, and the one module of hvdtrain that imports horovod.

``init()`` picks the backend (Horovod, or one process), starts it, pins devices and thread
pools, and returns a ``World``: rank, size, chief, and the few collectives the loop needs
(the gradients' reduction, broadcast, sums, barrier, agreement on errors, the elastic
driver). Nothing else in hvdtrain asks ``rank() == 0``; it asks ``world.is_chief``. The
optimizer wrapper (``optimizer.py``), the doctor and the benchmarks reach Horovod through
this module: ``World.reduction``, ``horovod_package()``, ``horovod_tensorflow()``,
``horovod_keras()``, ``World.hvd``.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

import numpy as np

from hvdtrain import timings
from hvdtrain.errors import (ConfigError, LaunchError, RankError, error_line,  # noqa: F401
                             first_line)  # (public)

# Variables launchers set in every process they start: mpirun (Open MPI, MPICH/Hydra,
# MVAPICH), horovodrun --gloo, and srun.
LAUNCHER_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                      "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


def launcher_size(environ=os.environ) -> int:
    """The number of processes a launcher says it started (1 when there is no launcher)."""
    sizes = []
    for name in LAUNCHER_SIZE_VARS:
        try:
            sizes.append(int(environ.get(name, "1")))
        except ValueError:
            pass
    return max(sizes, default=1)


def launcher_rank() -> int:
    """This process's rank as the launcher numbered it (0 without a launcher)."""
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Progress:
    """Where training stands (epoch, examples done in it, ...); ``commit`` is elastic's."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def commit(self) -> None:
        pass


# The names of World.any_true's and World.all_same's allreduces: the run's agreement questions
# (at its start, each checkpoint, epoch record and end). A Horovod timeline lists every eager
# allreduce as "HorovodAllreduce" whatever its name (bench.cases.summarize_timeline's
# training_rounds tells the steps' rounds apart instead).
QUESTIONS = ("hvdtrain.any", "hvdtrain.same")


class World:
    """One process's view of the job. The single-process world needs no Horovod."""

    backend = "single"
    elastic = False  # Horovod's elastic mode: the size may change after compilation

    def __init__(self):
        self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1

    @property
    def is_chief(self) -> bool:
        """Rank 0 owns printing, files, checkpoints: the seeds' chief worker."""
        return self.rank == 0

    def reduction(self, op: str = "average", compression: str = "none",
                  gradient_predivide_factor: float = 1.0) -> Optional["Reduction"]:
        """How an optimizer's gradients are reduced over the ranks: None in one process
        (there is nothing to reduce); the arguments are checked all the same."""
        _reduction(op, compression, gradient_predivide_factor)
        return None

    def allreduce_gradients(self, grads, op="average", compression="none",
                            gradient_predivide_factor=1.0) -> list:
        return list(grads)

    def broadcast_variables(self, variables) -> None:
        pass

    def allreduce_sum(self, values: Sequence[float], name: str = "hvdtrain.sum") -> np.ndarray:
        return np.asarray(values, dtype=np.float64)

    def sum_in_graph(self, tensor):
        """Sum a tensor over ranks inside a compiled step."""
        return tensor

    def sum_statistics(self, tensor):
        """Sum a layer's batch statistics over the ranks inside a step, differentiably: the
        gradient with respect to each rank's part is the sum of the ranks' gradients with
        respect to the total (``hvdtrain.layers.SyncBatchNormalization``)."""
        return tensor

    def broadcast_object(self, obj):
        return obj

    def allgather_object(self, obj) -> list:
        return [obj]

    def any_true(self, flag: bool) -> bool:
        """All ranks: whether ``flag`` is set on any rank."""
        return any(self.allgather_object(bool(flag)))

    def all_same(self, obj) -> bool:
        """All ranks: whether every rank passed an equal ``obj`` (the same answer on every
        rank). HorovodWorld answers from a digest of ``repr(obj)``: reprs that differ for
        equal objects read as not the same, so a caller that acts on False checks again."""
        everyone = self.allgather_object(obj)
        return all(o == everyone[0] for o in everyone)

    def barrier(self) -> None:
        pass

    def agree(self, fn: Callable, catch=(Exception,), merge=None):
        """Run ``fn`` on every rank; if it raised on any, raise RankError on all of them.

        Without this, a rank whose local file is corrupt exits while the others block in
        the next collective forever. ``merge``: an error class that, raised with the same
        message on every rank (an error in the user's code, say), is raised again as
        itself, said once, rather than as a RankError.
        """
        try:
            value, error = fn(), None
        except catch as e:
            value, error = None, (str(e), merge is not None and isinstance(e, merge))
        if not self.any_true(error is not None):  # the usual case: one number's round
            return value
        errors = self.allgather_object(error)
        failed = [(r, e[0]) for r, e in enumerate(errors) if e is not None]
        if failed:
            same = len(failed) == self.size and len({e for _, e in failed}) == 1
            if same and all(e[1] for e in errors):
                raise merge(failed[0][1])  # the same error everywhere: as it was raised
            if self.size == 1:
                raise RankError(failed[0][1])
            raise RankError("; ".join(f"rank {r}: {e}" for r, e in failed))
        return value

    def versions(self) -> dict:
        """Versions of the distributed stack, for the preflight comparison."""
        return {}

    def run_elastic(self, variables, body, **progress):
        raise LaunchError("--elastic needs Horovod under horovodrun's elastic mode "
                          "(--min-np/--max-np with --host-discovery-script)")

    def describe(self) -> str:
        return "1 process (no Horovod)"


class HorovodWorld(World):
    backend = "horovod"

    def __init__(self, hvd):
        super().__init__()
        self.hvd = hvd
        # Elastic worlds change size after compilation: they always take the collective path.
        self.elastic = bool(int(os.environ.get("HOROVOD_ELASTIC", "0") or 0))
        self._refresh()

    def _refresh(self) -> None:
        """Read rank and size from Horovod: at start, and after each elastic reset."""
        hvd = self.hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.controller = "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "?"

    @property
    def alone(self) -> bool:
        """One rank that stays one (not elastic): each collective is the identity, and the
        host ones below skip Horovod (TensorFlow ops and a background-thread round each: 0.2 s
        of a one-process run's agreement on 2 cores, docs/PERFORMANCE.md)."""
        return self.size == 1 and not self.elastic

    def run_elastic(self, variables, body, **progress):
        """Run ``body(state)`` under Horovod's elastic driver; ``state`` is the Progress.

        The driver syncs rank 0's ``variables`` and progress to every worker at each
        (re)start, rolls back to the last ``commit()`` when a worker fails, and calls ``body``
        again with the new world.
        """
        import tensorflow as tf
        from horovod.common.exceptions import HorovodInternalError

        state = _elastic_state(self.hvd, variables, progress)
        state.register_reset_callbacks([self._refresh])

        def run(state):
            self._refresh()  # a new worker's first call, and every call after a reset
            try:
                return body(state)
            except tf.errors.UnknownError as e:
                # Horovod's wrapper turns an UnknownError into a reset only when its message
                # names HorovodAllreduce/Allgather/Broadcast, and silently *returns None* for
                # any other: a failed grouped allreduce (HorovodGroupedAllreduce) ended the
                # worker with status 0 and no result. Decide here instead.
                if "Horovod" in e.message:
                    raise HorovodInternalError(e) from None  # a lost peer: roll back, go on
                raise RuntimeError(f"{type(e).__name__}: {first_line(e.message)}") from None

        result = self.hvd.elastic.run(run)(state)
        if result is None:
            raise LaunchError("the elastic run ended without a result (Horovod's elastic "
                              "driver swallowed an error)")
        return result

    def reduction(self, op: str = "average", compression: str = "none",
                  gradient_predivide_factor: float = 1.0) -> "Reduction":
        op, compression = _reduction(op, compression, gradient_predivide_factor, self.hvd)
        return Reduction(self, op, compression, gradient_predivide_factor)

    def allreduce_gradients(self, grads, op="average", compression="none",
                            gradient_predivide_factor=1.0) -> list:
        """Average (or sum) gradients over all ranks, inside a compiled step.

        One grouped allreduce: Horovod negotiates and fuses every gradient in one round.
        None gradients (variables the loss does not reach) stay None; sparse gradients
        (tf.IndexedSlices, from embeddings) are reduced dense, like Horovod's
        sparse_as_dense=True.
        """
        import tensorflow as tf

        if self.alone:
            return list(grads)  # nothing to average; skip the background thread's cycle
        hvd = self.hvd
        op, compression = _reduction(op, compression, gradient_predivide_factor, hvd)
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        # Horovod: split an average across pre- and post-scaling (as its own wrapper does);
        # the C++ side divides the postscale by the world size.
        scale = dict(prescale_factor=1.0 / gradient_predivide_factor,
                     postscale_factor=gradient_predivide_factor) if op == hvd.Average else {}
        tensors = [tf.convert_to_tensor(grads[i]) for i in present]
        if op == hvd.Adasum:
            # Horovod 0.28.1's grouped_allreduce fails with Adasum (it reads an unset local,
            # "'tensor' is used before assignment"); one Adasum allreduce per tensor works.
            reduced = [hvd.allreduce(t, op=op, compression=compression) for t in tensors]
        else:
            reduced = hvd.grouped_allreduce(tensors, op=op, compression=compression, **scale)
        for i, g in zip(present, reduced):
            grads[i] = g
        return grads

    def broadcast_variables(self, variables) -> None:
        # Horovod: start every rank from rank 0's state (initial, or restored). Keras 3's
        # variables wrap the tf.Variables Horovod broadcasts.
        from hvdtrain.compat import tf_variables

        if not self.alone:
            broadcast_variables(self.hvd, tf_variables(variables))

    def allreduce_sum(self, values: Sequence[float], name: str = "hvdtrain.sum") -> np.ndarray:
        """The sum over ranks; ``name``: the Horovod op's."""
        import tensorflow as tf

        if self.alone:
            return World.allreduce_sum(self, values)
        tensor = tf.constant(np.asarray(values, dtype=np.float64))
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name).numpy()

    def sum_in_graph(self, tensor):
        if self.alone:
            # A one-rank sum is the tensor: skip the round trip through Horovod's background
            # thread, which waits up to a cycle (HOROVOD_CYCLE_TIME).
            return tensor
        # A round of its own: the training step puts its flags in the gradients' grouped
        # allreduce instead (hvdtrain.optimizer.apply_gradients); this is for Adasum only.
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name="hvdtrain.flags")

    def sum_statistics(self, tensor):
        # Horovod: a round of its own where the layer stands in the forward pass (the next
        # layer needs the statistics: they cannot wait for the gradients' grouped allreduce),
        # and one in the backward pass: Horovod's gradient of a Sum allreduce is a Sum
        # allreduce. No name: TensorFlow's unique op name in the traced step names it alike
        # on every rank.
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def broadcast_object(self, obj):
        return obj if self.alone else self.hvd.broadcast_object(obj, root_rank=0)

    def allgather_object(self, obj) -> list:
        return [obj] if self.alone else self.hvd.allgather_object(obj)

    # The object collectives pickle and take two rounds each (the sizes, then the bytes);
    # these two questions, asked at every checkpoint and epoch, take one small allreduce.
    def any_true(self, flag: bool) -> bool:
        return bool(self.allreduce_sum([1.0 if flag else 0.0], name=QUESTIONS[0])[0] > 0)

    def all_same(self, obj) -> bool:
        """One allreduce of 32 numbers: the sums over ranks of 16 8-bit pieces of the
        sha256 of ``repr(obj)`` and of their squares. size * sum(h^2) == sum(h)^2 exactly
        when every rank's h is the same (Cauchy-Schwarz); both sides are integers that
        float64 holds exactly up to 2^18 ranks, and every rank decides from the same sums."""
        if self.alone:
            return True
        import hashlib

        digest = hashlib.sha256(repr(obj).encode("utf-8", "backslashreplace")).digest()
        h = np.frombuffer(digest[:16], dtype=np.uint8).astype(np.float64)
        total = self.allreduce_sum(np.concatenate([h, h * h]), name=QUESTIONS[1])
        return bool(np.array_equal(self.size * total[16:], total[:16] ** 2))

    def barrier(self) -> None:
        # An allreduce returns only once every rank has entered it.
        self.allreduce_sum([0.0])

    def versions(self) -> dict:
        import horovod

        return {"horovod": horovod.__version__, "controller": self.controller}

    def describe(self) -> str:
        return f"{self.size} process{'es' if self.size > 1 else ''}, Horovod over {self.controller}"


class Reduction:
    """One optimizer's gradient reduction over the ranks (``World.reduction``): what
    ``hvdtrain.DistributedOptimizer`` calls before every update."""

    def __init__(self, world: HorovodWorld, op, compression, gradient_predivide_factor: float):
        self.world, self.op, self.compression = world, op, compression
        self.gradient_predivide_factor = gradient_predivide_factor
        # Adasum's combination is meant for gradients only: other tensors (the step's flags)
        # cannot ride in its round.
        self.carries_riders = op != world.hvd.Adasum

    def __call__(self, grads) -> list:
        # Horovod: average gradients over all ranks with ring-allreduce before each update,
        # the synchronous update SyncReplicasOptimizer made.
        return self.world.allreduce_gradients(grads, self.op, self.compression,
                                              self.gradient_predivide_factor)

    def sum(self, tensor):
        """A tensor summed over the ranks in a round of its own (for Adasum's riders)."""
        return self.world.sum_in_graph(tensor)

    def keras2_optimizer(self, optimizer, backward_passes_per_step: int = 1):
        """Keras 2: Horovod's own wrapper (it averages in minimize/get_gradients; with
        backward_passes_per_step, the mean of that many calls' gradients every that many).

        Horovod's wrapper reduces in ``minimize`` (what Keras 2's own train_step calls) and
        applies what ``apply_gradients`` is given: a model's own train_step that calls
        ``apply_gradients`` itself (a GAN's) would apply each rank's own gradients, the ranks
        drifting apart without a word. Here ``apply_gradients`` reduces them first unless
        ``minimize`` just did (Horovod's ``_aggregated_gradients``, reset after each apply;
        hvdtrain's own step, which reduces with its riders, marks them reduced)."""
        opt = horovod_keras().DistributedOptimizer(
            optimizer, op=self.op, compression=self.compression,
            gradient_predivide_factor=self.gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=True)
        horovods = opt.apply_gradients  # bound: Horovod's class calls super(self.__class__)

        def apply_gradients(grads_and_vars, *args, **kwargs):
            if not opt._aggregated_gradients:
                if opt._agg_helper is not None:
                    raise ConfigError("backward_passes_per_step", backward_passes_per_step,
                                      "under Keras 2 it accumulates in minimize(), and this "
                                      "model's own train_step calls apply_gradients itself: "
                                      "use Keras 3, or no accumulation")
                pairs = [(g, v) for g, v in grads_and_vars]
                reduced = opt._allreduce([g for g, _ in pairs], [v for _, v in pairs])
                grads_and_vars = list(zip(reduced, [v for _, v in pairs]))
            object.__setattr__(opt, "_aggregated_gradients", False)
            return horovods(grads_and_vars, *args, **kwargs)

        object.__setattr__(opt, "apply_gradients", apply_gradients)
        # Horovod's reduction: one op per tensor. hk.fit's stop flags go as one more op,
        # enqueued after the gradients (StopFlags.ride), so Horovod fuses them into the
        # gradients' round: 487 MPI rounds for 468 steps and 15 host collectives (Horovod
        # timeline, softmax, spe 1), against 483 when grouped with them.
        horovods_reduce = opt._allreduce_grads

        def allreduce_grads(grads, vars=None, use_generic_names=False):
            # hk.fit's stop flags (optimizer.StopFlags) ride in the gradients' round
            flags = getattr(opt, "_hvdtrain_stop_flags", None)
            if flags is None:
                return horovods_reduce(grads, vars, use_generic_names)
            names = None if vars is None else list(vars) + [flags.total]
            return flags.ride(lambda tensors: horovods_reduce(tensors, names, use_generic_names),
                              list(grads))

        object.__setattr__(opt, "_allreduce_grads", allreduce_grads)
        return opt


def _elastic_state(hvd, variables, progress):
    """Horovod elastic state over a list of variables (model and optimizer) plus progress.

    Horovod's TensorFlowKerasState (which works under Keras 3 with scripts/patches/python/)
    holds one model and one optimizer, not a list of variables, and its TensorFlowState
    broadcasts only once, at construction, in eager mode. This one does what
    TensorFlowKerasState does, over the tf.Variables behind either Keras: broadcast rank 0's
    values at every sync, keep a copy at every commit, put it back after a failure.
    """
    from horovod.common.elastic import ObjectState

    from hvdtrain.compat import tf_variables

    class VariablesState(ObjectState):
        def __init__(self):
            self.variables = tf_variables(variables)
            self._save_variables()
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **progress)

        def save(self):
            self._save_variables()
            super().save()

        def restore(self):
            for variable, value in zip(self.variables, self._saved):
                variable.assign(value)
            super().restore()

        def sync(self):
            broadcast_variables(hvd, self.variables)
            self._save_variables()
            super().sync()

        def _save_variables(self):
            self._saved = [v.numpy() for v in self.variables]

    return VariablesState()


def broadcast_variables(hvd, variables) -> None:
    """Rank 0's values into ``variables`` on every rank: Horovod's ``broadcast_variables``
    (one broadcast per variable, in one traced function), traced without AutoGraph. Horovod's
    own traces a new tf.function with AutoGraph at every call, converting its own code: 0.38 s
    of the README's first command's agreement on a quiet machine, for 5 variables."""
    import tensorflow as tf

    def group(variables):
        for variable in variables:
            variable.assign(hvd.broadcast(variable, root_rank=0))

    tf.function(group, autograph=False)(list(variables))


OPS = ("average", "sum", "adasum")
COMPRESSIONS = ("none", "fp16")


def _reduction(op, compression, gradient_predivide_factor, hvd=None):
    """Check a gradient reduction's settings; with Horovod, return its (op, compression).

    ``op`` and ``compression`` are names (``"average"``, ``"fp16"``) or Horovod's own
    objects (``hvd.Average``, ``hvd.Compression.fp16``).
    """
    if isinstance(op, str) and op.lower() not in OPS:
        raise ValueError(f"op={op!r}: choose one of {', '.join(OPS)}")
    if isinstance(compression, str) and compression.lower() not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r}: choose one of {', '.join(COMPRESSIONS)}")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r}: must be > 0")
    average = op.lower() == "average" if isinstance(op, str) else (
        hvd is not None and op == hvd.Average)
    if gradient_predivide_factor != 1.0 and not average:
        raise ValueError("gradient_predivide_factor applies to op='average' only")
    if hvd is None:
        return op, compression
    if isinstance(op, str):
        op = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[op.lower()]
    if isinstance(compression, str):
        compression = getattr(hvd.Compression, compression.lower())
    return op, compression


def horovod_package():
    """The ``horovod`` package (its version, its files), for reports on the build."""
    import horovod

    return horovod


def horovod_tensorflow():
    """``horovod.tensorflow``: fails if Horovod was built without TensorFlow or against
    another TensorFlow."""
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
    except Exception as e:  # ImportError, or a TF op library built for another TensorFlow
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
            print(f"hvdtrain: warning: cannot pin GPU {local_rank % len(gpus)} to local rank "
                  f"{local_rank} ({e}): start hvdtrain before using TensorFlow",
                  file=sys.stderr, flush=True)
    if "TF_NUM_INTRAOP_THREADS" not in os.environ:
        # Two ranks on two cores each running a full-width pool oversubscribe the CPU.
        threads = max(1, usable_cores() // max(1, local_size))
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
        except RuntimeError:
            pass  # TensorFlow already ran (the caller used it first): its pools stay


# Horovod and Open MPI settings hvdtrain chooses when the user has not (measured on 2 cores,
# 2 ranks, in docs/PERFORMANCE.md). All are read once, at hvd.init().
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
    ran 12 % slower than with 1 ms (docs/PERFORMANCE.md), so one rank keeps Horovod's 1 ms.
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
    several = launcher_size(environ) > 1 or environ.get("HOROVOD_ELASTIC") == "1"
    if "HOROVOD_CYCLE_TIME" not in environ and several:
        chosen["HOROVOD_CYCLE_TIME"] = HOROVOD_CYCLE_TIME_MS
    local = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    if (local.isdigit() and int(local) >= usable_cores()
            and "OMPI_MCA_mpi_yield_when_idle" not in environ):
        chosen["OMPI_MCA_mpi_yield_when_idle"] = "1"
    if environ.get("OMPI_MCA_btl") == HOROVODRUN_BTL and local and \
            local == environ.get("OMPI_COMM_WORLD_SIZE"):
        chosen["OMPI_MCA_btl"] = ONE_HOST_BTL
    environ.update(chosen)
    return chosen


_current: Optional[World] = None


def current() -> World:
    """The World ``init()`` made in this process (started with backend auto if none yet)."""
    return _current if _current is not None else init()


def init(backend: str = "auto", num_workers: Optional[int] = None,
         notice: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
         elastic: bool = False) -> World:
    """Start the backend and return this process's World.

    backend: "auto" (Horovod if importable, else one process), "horovod" or "single".
    num_workers: the configured count; compared with the launcher's and warned about.
    elastic: the run needs Horovod's elastic driver (no fallback to one process).
    """
    with timings.phase("horovod_init"):  # its first import of Horovod's module: imports
        return _init(backend, num_workers, notice, elastic)


def _init(backend, num_workers, notice, elastic) -> World:
    launched = launcher_size()
    if backend == "single":
        if launched > 1:
            raise LaunchError(f"--backend single, but a launcher started {launched} processes: "
                              f"they would train {launched} independent copies")
        world = World()
    else:
        hvd, why = _import_horovod()
        if hvd is None:
            if backend == "horovod" or launched > 1 or elastic:
                raise LaunchError(
                    f"horovod cannot be imported ({why}), but "
                    + (f"a launcher started {launched} processes: refusing to train "
                       f"{launched} independent copies" if launched > 1 else
                       "--backend horovod asks for it" if backend == "horovod" else
                       "--elastic needs it")
                    + "; run scripts/setup.sh")
            notice(f"hvdtrain: horovod unavailable ({why}); training in one process "
                   "with the plain optimizer")
            world = World()
        else:
            _horovod_defaults()
            hvd.init()
            world = HorovodWorld(hvd)
    _configure_devices(world.local_rank, world.local_size)
    global _current
    _current = world
    # Without a launcher there is no count to disagree with: one process is simply one.
    if (num_workers is not None and num_workers != world.size and world.is_chief
            and any(name in os.environ for name in LAUNCHER_SIZE_VARS)):
        notice(f"hvdtrain: warning: --num-workers is {num_workers} but the launcher started "
               f"{world.size} process(es); training with world size {world.size}")
    return world
