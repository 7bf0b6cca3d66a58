"""The World interface: one process's view of the job (rank, size, chief, and the few
collectives the loop needs: the gradients' reduction, broadcast, sums, barrier, agreement on
errors, the elastic driver), and the single-process World, which needs no Horovod. Nothing
else in hvdtrain asks ``rank() == 0``; it asks ``world.is_chief``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from hvdtrain.base.errors import EnvError, LaunchError, RankError


@dataclasses.dataclass
class Progress:
    """Where training stands, as a checkpoint or an elastic commit keeps it.

    Under Horovod's elastic driver the drivers get its elastic state instead, which holds the
    same fields (``fields()``) and commits them; ``commit`` here does nothing.

    Attributes:
        epoch: the epochs finished (None: a fresh start, nothing restored).
        offset: the examples of the next epoch already trained, over all ranks.
        sums: that epoch's metric sums so far over every rank (None: none kept).
        last_record: the newest finished epoch's record (a dict, as metrics.jsonl has it).
        path: the checkpoint it was restored from (None: none).
    """

    epoch: int | None = None
    offset: int | None = None
    sums: list | None = None
    last_record: dict | None = None
    path: str | None = None

    def fields(self) -> dict:
        """The fields by name (what Horovod's elastic state is made from)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def commit(self) -> None:
        pass


def steps_done(progress, step_examples: int, steps: int) -> int:
    """The steps of the next epoch already trained: ``progress.offset`` examples in steps of
    ``step_examples`` (over all ranks), at most ``steps``. After a resume or an elastic reset
    with another world size the epoch continues after the same examples, rounded up to a
    whole step of the new size. ``progress``: a ``Progress`` or the elastic state."""
    return min(-(-progress.offset // step_examples), steps)


# The names of World.any_true's and World.all_same's allreduces: the run's agreement questions
# (at its start, each checkpoint, epoch record and end). A Horovod timeline lists every eager
# allreduce as "HorovodAllreduce" whatever its name (bench.cases.summarize_timeline's
# training_rounds tells the steps' rounds apart instead).
QUESTIONS = ("hvdtrain.any", "hvdtrain.same")


class GradientReduction(Protocol):
    """What an optimizer's gradients go through before each update (``World.reduction``; in
    a Horovod job, ``horovod_world.Reduction``)."""

    carries_riders: bool  # whether other tensors (the step's flags) may ride in its round

    def __call__(self, grads) -> list:
        """The gradients reduced over the ranks."""

    def sum(self, tensor):
        """A tensor summed over the ranks in a round of its own."""

    def keras2_optimizer(self, optimizer, backward_passes_per_step: int = 1):
        """Keras 2: the optimizer wrapped so that it reduces before it applies."""


class World:
    """One process's view of the job. The single-process world needs no Horovod."""

    backend = "single"
    elastic = False  # Horovod's elastic mode: the size may change after compilation

    def __init__(self):
        self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1
        # The run directories this process's runs finished: given again to a run of this
        # process (hk.fit's second phase of training), not a rerun of the same command.
        self.finished_runs: set = set()

    @property
    def is_chief(self) -> bool:
        """Rank 0 owns printing, files, checkpoints: the seeds' chief worker."""
        return self.rank == 0

    def reduction(
        self, op: str = "average", compression: str = "none", gradient_predivide_factor: float = 1.0
    ) -> GradientReduction | None:
        """How an optimizer's gradients are reduced over the ranks: None in one process
        (there is nothing to reduce); the arguments and HVDTRAIN_BUCKET_BYTES are checked all
        the same."""
        reduction_ops(op, compression, gradient_predivide_factor)
        configured_bucket_bytes()
        return None

    def allreduce_gradients(
        self,
        grads,
        op="average",
        compression="none",
        gradient_predivide_factor=1.0,
        sparse_ratio=None,
        bucket_bytes=None,
    ) -> list:
        return list(grads)

    def broadcast_variables(self, variables) -> None:
        pass

    def allreduce_sum(
        self, values: Sequence[float] | np.ndarray, name: str = "hvdtrain.sum"
    ) -> np.ndarray:
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
        raise LaunchError(
            "--elastic needs Horovod under horovodrun's elastic mode "
            "(--min-np/--max-np with --host-discovery-script)"
        )

    def describe(self) -> str:
        return "1 process (no Horovod)"


OPS = ("average", "sum", "adasum")
COMPRESSIONS = ("none", "fp16")


# The gradients' bucket size (HVDTRAIN_BUCKET_BYTES overrides it; 0: one bucket). Horovod's
# own wrappers reduce each gradient on its own and fuse what is ready in a cycle; a bucket is
# one negotiation for many small gradients. 4 MiB, where an allreduce starts to be bound by
# bandwidth rather than by its fixed cost (ALONE_BYTES): a bucket waits for its earliest
# layer's gradient, so 25 MiB buckets of small gradients left ResNet-50's first stages for
# after the backward pass (21 ms of its step not hidden; 12 ms with these buckets, Horovod's
# tape 2 ms: docs/performance/models.md). Under Horovod's fusion threshold (128 MiB): Horovod
# never cuts a bucket and fuses the buckets that are ready in the same cycle.
BUCKET_BYTES = 4 << 20
# A gradient this large (or a whole bucket's worth, if less) is reduced on its own, a group of
# one: Horovod then reduces it in place, where a group of several is copied into its fusion
# buffer and out again (on a CPU, 2 x 151 MB of copies a step for the wide MLP: a tenth of
# its 2-process step, docs/performance/models.md). From about this size an allreduce is
# bound by bandwidth, not by its fixed cost, so fusing it saves nothing.
ALONE_BYTES = 4 << 20
# The last bucket: the model's first tensors (and the step's flags, in front), up to this
# many bytes (and at most a bucket). It is issued when the backward pass ends, so all of it
# is communication left exposed: kept small, as Horovod's own last gradient is.
LAST_BUCKET_BYTES = 1 << 20


def configured_bucket_bytes(environ=os.environ) -> int:
    """HVDTRAIN_BUCKET_BYTES, or ``BUCKET_BYTES``: the gradients' bucket size in bytes."""
    raw = environ.get("HVDTRAIN_BUCKET_BYTES", "").strip()
    if not raw:
        return BUCKET_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise EnvError(
            f"HVDTRAIN_BUCKET_BYTES={raw}: give a size in bytes, 0 or more (0: all "
            f"gradients in one grouped allreduce; default {BUCKET_BYTES})"
        )
    return value


def reduction_ops(op, compression, gradient_predivide_factor, hvd=None):
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
    average = (
        op.lower() == "average" if isinstance(op, str) else (hvd is not None and op == hvd.Average)
    )
    if gradient_predivide_factor != 1.0 and not average:
        raise ValueError("gradient_predivide_factor applies to op='average' only")
    if hvd is None:
        return op, compression
    if isinstance(op, str):
        op = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[op.lower()]
    if isinstance(compression, str):
        compression = getattr(hvd.Compression, compression.lower())
    return op, compression
