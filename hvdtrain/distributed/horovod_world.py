"""The World over Horovod: its collectives, the gradients' reduction (``Reduction``: what
``hvdtrain.DistributedOptimizer`` calls before every update) and Horovod's elastic state."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from hvdtrain.base.errors import ConfigError, LaunchError, first_line
from hvdtrain.distributed import sparse
from hvdtrain.distributed.horovod_setup import horovod_keras
from hvdtrain.distributed.world import (
    ALONE_BYTES,
    LAST_BUCKET_BYTES,
    QUESTIONS,
    World,
    configured_bucket_bytes,
    reduction_ops,
)


def _buckets(
    tensors, bucket_bytes: int, alone_bytes: int = ALONE_BYTES, last_bytes: int = LAST_BUCKET_BYTES
) -> list:
    """The tensors' indices in buckets, in the order the backward pass completes them (by
    their first tensor, from the last; the backward pass produces the last tensors first).
    A tensor of ``alone_bytes`` or more (or of ``bucket_bytes``, if less) is a bucket of its
    own, issued where the backward pass produces it. The smaller ones gather from the first
    tensor on: the first bucket, which waits for the end of the backward pass (what it holds
    is what the reduction leaves exposed), takes the first tensors while they fit in
    ``last_bytes`` (at most a bucket), and closes there if it holds two or more (the step's
    flags alone would be a negotiation round for nothing); each next one closes once it
    holds ``bucket_bytes`` or more (0: one bucket of all). Sizes come from static shapes and
    dtypes only, so every rank cuts the same buckets: Horovod matches a grouped allreduce
    across ranks by its tensors."""
    if not tensors:
        return []
    if bucket_bytes <= 0:
        return [list(range(len(tensors)))]
    alone, last = min(alone_bytes, bucket_bytes), min(last_bytes, bucket_bytes)
    sizes = [(t.shape.num_elements() or 0) * t.dtype.size for t in tensors]
    buckets: list[list[int]] = []
    bucket: list[int] = []
    size, first = 0, True
    for i, nbytes in enumerate(sizes):
        if nbytes >= alone:
            buckets.append([i])
            continue
        if first and size + nbytes > last:
            first = False
            if len(bucket) >= 2:
                buckets.append(bucket)
                bucket, size = [], 0
        bucket.append(i)
        size += nbytes
        if not first and size >= bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return sorted(buckets, key=lambda b: -b[0])


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
        of a one-process run's agreement on 2 cores, docs/performance/startup.md)."""
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
            raise LaunchError(
                "the elastic run ended without a result (Horovod's elastic "
                "driver swallowed an error)"
            )
        return result

    def reduction(
        self, op: str = "average", compression: str = "none", gradient_predivide_factor: float = 1.0
    ) -> Reduction:
        op, compression = reduction_ops(op, compression, gradient_predivide_factor, self.hvd)
        return Reduction(self, op, compression, gradient_predivide_factor)

    def allreduce_gradients(
        self,
        grads,
        op="average",
        compression="none",
        gradient_predivide_factor=1.0,
        sparse_ratio=None,
        bucket_bytes=None,
    ) -> list:
        """Average (or sum) gradients over all ranks, inside a compiled step.

        In buckets of about ``bucket_bytes`` (default: ``configured_bucket_bytes()``,
        HVDTRAIN_BUCKET_BYTES), one grouped allreduce each: Horovod negotiates a
        bucket as one and fuses the buckets that are ready in the same cycle, and a bucket
        leaves as soon as its own gradients exist, while the backward pass computes the rest.
        The backward pass produces the last variables' gradients first and the first ones'
        last: ``grads``' first tensors, up to LAST_BUCKET_BYTES, are the last bucket (where
        ``optimizer._reduce_riding`` puts the step's flags, which wait for every gradient);
        ``_buckets`` says how the rest are cut.
        None gradients (variables the loss does not reach) stay None. A sparse gradient
        (tf.IndexedSlices, from an Embedding) is gathered sparse when that sends less
        (``hvdtrain.distributed.sparse``; ``sparse_ratio``: its threshold, None: the
        environment's), else reduced dense like Horovod's sparse_as_dense=True; either way
        it comes back dense, the gradient the dense reduction gives.
        """
        import tensorflow as tf

        if self.alone:
            return list(grads)  # nothing to average; skip the background thread's cycle
        hvd = self.hvd
        op, compression = reduction_ops(op, compression, gradient_predivide_factor, hvd)
        grads, gathered = sparse.reduce_gathered(
            self,
            grads,
            op,
            compression,
            gradient_predivide_factor,
            sparse.ratio() if sparse_ratio is None else sparse_ratio,
        )
        present = [i for i, g in enumerate(grads) if g is not None and i not in gathered]
        if not present:
            return grads
        # Horovod: split an average across pre- and post-scaling (as its own wrapper does);
        # the C++ side divides the postscale by the world size.
        scale = (
            dict(
                prescale_factor=1.0 / gradient_predivide_factor,
                postscale_factor=gradient_predivide_factor,
            )
            if op == hvd.Average
            else {}
        )
        tensors = [tf.convert_to_tensor(grads[i]) for i in present]
        if op == hvd.Adasum:
            # Horovod 0.28.1's grouped_allreduce fails with Adasum (it reads an unset local,
            # "'tensor' is used before assignment"); one Adasum allreduce per tensor works.
            reduced = [hvd.allreduce(t, op=op, compression=compression) for t in tensors]
        else:
            reduced = [None] * len(tensors)
            limit = configured_bucket_bytes() if bucket_bytes is None else bucket_bytes
            for bucket in _buckets(tensors, limit):
                out = hvd.grouped_allreduce(
                    [tensors[j] for j in bucket], op=op, compression=compression, **scale
                )
                for j, r in zip(bucket, out):
                    reduced[j] = r
        for i, g in zip(present, reduced):
            grads[i] = g
        return grads

    def broadcast_variables(self, variables) -> None:
        # Horovod: start every rank from rank 0's state (initial, or restored). Keras 3's
        # variables wrap the tf.Variables Horovod broadcasts.
        from hvdtrain.base.compat import tf_variables

        if not self.alone:
            broadcast_variables(self.hvd, tf_variables(variables))

    def allreduce_sum(
        self, values: Sequence[float] | np.ndarray, name: str = "hvdtrain.sum"
    ) -> np.ndarray:
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
        # A round of its own: the training step puts its flags in the gradients' last
        # bucket instead (hvdtrain.distributed.optimizer.apply_gradients); this is for Adasum only.
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name="hvdtrain.flags")

    def sum_statistics(self, tensor):
        # Horovod: a round of its own where the layer stands in the forward pass (the next
        # layer needs the statistics: they cannot wait for the gradients' reduction),
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
        # Read once, where the optimizer is wrapped: a bad value stops before any tracing.
        self.bucket_bytes = configured_bucket_bytes()
        # Adasum's combination is meant for gradients only: other tensors (the step's flags)
        # cannot ride in its round.
        self.carries_riders = op != world.hvd.Adasum
        # Read once, here: a bad value stops every rank at DistributedOptimizer(), before
        # anything is traced.
        self.sparse_ratio = sparse.ratio()

    def __call__(self, grads) -> list:
        # Horovod: average gradients over all ranks with ring-allreduce before each update,
        # the synchronous update SyncReplicasOptimizer made (sparse ones gathered when that
        # sends less).
        return self.world.allreduce_gradients(
            grads,
            self.op,
            self.compression,
            self.gradient_predivide_factor,
            self.sparse_ratio,
            self.bucket_bytes,
        )

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
            optimizer,
            op=self.op,
            compression=self.compression,
            gradient_predivide_factor=self.gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=True,
        )
        horovods = opt.apply_gradients  # bound: Horovod's class calls super(self.__class__)

        def apply_gradients(grads_and_vars, *args, **kwargs):
            if not opt._aggregated_gradients:
                if opt._agg_helper is not None:
                    raise ConfigError(
                        "backward_passes_per_step",
                        backward_passes_per_step,
                        "under Keras 2 it accumulates in minimize(), and this "
                        "model's own train_step calls apply_gradients itself: "
                        "use Keras 3, or no accumulation",
                    )
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
            names = None if vars is None else [flags.total] + list(vars)  # riders first
            return flags.ride(
                lambda tensors: horovods_reduce(tensors, names, use_generic_names), list(grads)
            )

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

    from hvdtrain.base.compat import tf_variables

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
