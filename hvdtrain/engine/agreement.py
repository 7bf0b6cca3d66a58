"""At a run's end every rank must hold the same weights (synchronous updates): their digests
compared over the ranks, and what to do when they differ."""

from __future__ import annotations


def weights_agreement(world, model) -> dict:
    """Every rank must end with the same weights (synchronous updates): compare digests.

    Returns ``weights_sha256`` (rank 0's), ``ranks_identical`` for result.json, and
    ``differ``, the ranks whose weights or layers' state are not rank 0's (empty when
    identical). One host allreduce on every rank (``World.all_same``); the allgather that
    names the ranks only when they differ.
    """
    import hashlib

    import numpy as np

    from hvdtrain.base.compat import variables
    from hvdtrain.engine.preflight import layer_state

    digest = hashlib.sha256()
    for v in variables(model.weights):
        digest.update(np.ascontiguousarray(v.numpy()).tobytes())
    # The state outside the weights (vocabularies, Normalization's tensors) is compared too:
    # ranks with other vocabularies are other models even with the same weights.
    state = layer_state(model)
    mine = (digest.hexdigest(), state)
    if world.all_same(mine):
        return {"weights_sha256": mine[0], "ranks_identical": True, "differ": []}
    digests = world.allgather_object(mine)
    differ = [r for r, (d, s) in enumerate(digests) if d != digests[0][0] or s != digests[0][1]]
    return {"weights_sha256": digests[0][0], "ranks_identical": not differ, "differ": differ}


def ranks_differ_line(differ, step: int, fit: bool) -> str:
    """Why the ranks' models can differ after synchronous updates, and what to do."""
    where = "the model's own train_step, a callback" if fit else "the task's code"
    return (
        f"the model of rank(s) {differ} differs from rank 0's at step {step} (weights or "
        f"layers' state): something changed it outside the distributed optimizer on "
        f"each rank alone ({where}: a variable's assign/assign_add/assign_sub, or an "
        f"optimizer that is not hk.DistributedOptimizer); every update must go through "
        f"the distributed optimizer, or be the same on every rank"
    )
