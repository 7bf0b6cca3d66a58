"""The gradients' reduction overlaps the backward pass: a gradient bucket's allreduce starts
before the backward pass has produced the last bucket's gradients on every rank.

A Horovod timeline of a real 2-process run of a small ResNet (tests/overlap_script.py) by the
Task path and by hk.fit, in one launch, shows it step by step: the first bucket is being
reduced (its ALLREDUCE began) before the last bucket's negotiation ends (NEGOTIATE_ALLREDUCE
ends when every rank has enqueued it: the slowest rank's backward pass is over). With all
gradients in one grouped allreduce that cannot be: its reduction begins after its
negotiation. Under Keras 3 the buckets are hvdtrain's (HVDTRAIN_BUCKET_BYTES); under Keras 2
the fit path is Horovod's own wrapper, one allreduce per gradient, and the same holds.
"""

import collections
import os
import re

import pytest

from conftest import KERAS2, TESTS, clean_env, run, script_cmd
from hvdtrain.bench.cases import read_timeline

STEPS = 8
# Small enough to cut the small ResNet's 300,000 weights (1.2 MB) in 6 buckets.
BUCKET_BYTES = 100_000
# By this much (microseconds), ten of Horovod's 0.1 ms cycles: a backward pass still running,
# not one rank's enqueues of its ready buckets split by a cycle's edge.
MARGIN_US = 1000


def units_per_path(path, steps) -> list:
    """The units the gradients are reduced in (a grouped allreduce, or one tensor's own op),
    each {"ready": [...], "reduced": [...]} per step: when its negotiation ended, when its
    reduction began (rank 0's timeline, in microseconds). Split by path: the units whose
    steps' spans overlap (one compiled step) go together, so the Task path's, then the fit
    path's. Tensors negotiated other than ``steps`` times (the host's collectives) are left
    out."""
    events = read_timeline(path)
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})
    }
    times = collections.defaultdict(lambda: collections.defaultdict(list))
    open_ = collections.defaultdict(list)  # each tensor's open activities (E has no name)
    for e in events:
        if e.get("ph") == "B":
            open_[e["pid"]].append(e["name"])
            if e["name"] in ("NEGOTIATE_ALLREDUCE", "ALLREDUCE"):
                times[names[e["pid"]]][e["name"]].append(e["ts"])
        elif e.get("ph") == "E" and open_[e.get("pid")]:
            if open_[e["pid"]].pop() == "NEGOTIATE_ALLREDUCE":
                times[names[e["pid"]]]["ready"].append(e["ts"])
    tensors = collections.defaultdict(list)  # a group's tensors (..._KofN): one unit
    for name, by in times.items():
        if len(by) == 3 and all(len(t) == steps for t in by.values()):
            tensors[re.sub(r"_\d+of\d+$", "", name)].append(by)
    units = {
        unit: {
            "enqueued": [min(t) for t in zip(*(b["NEGOTIATE_ALLREDUCE"] for b in bys))],
            "ready": [max(t) for t in zip(*(b["ready"] for b in bys))],
            "reduced": [min(t) for t in zip(*(b["ALLREDUCE"] for b in bys))],
        }
        for unit, bys in tensors.items()
    }
    paths = []
    for unit in sorted(units, key=lambda u: units[u]["enqueued"][0]):
        if paths and units[unit]["enqueued"][0] <= max(units[u]["enqueued"][-1] for u in paths[-1]):
            paths[-1][unit] = units[unit]
        else:
            paths.append({unit: units[unit]})
    return paths


def overlapped_steps(units, steps) -> list:
    """The steps in which a unit's reduction began before the last unit was ready on every
    rank, i.e. while a rank's backward pass was still producing gradients."""
    return [
        s
        for s in range(steps)
        if min(u["reduced"][s] for u in units.values()) + MARGIN_US
        < max(u["ready"][s] for u in units.values())
    ]


@pytest.mark.keras2
def test_first_bucket_is_reduced_while_the_backward_pass_runs(tmp_path):
    timeline = tmp_path / "timeline.json"
    env = clean_env(
        tmp_path / "home", HOROVOD_TIMELINE=timeline, HVDTRAIN_BUCKET_BYTES=BUCKET_BYTES
    )
    p = run(
        script_cmd(2, os.path.join(TESTS, "overlap_script.py"), tmp_path / "r", "--steps", STEPS),
        env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    task, fit = units_per_path(str(timeline), STEPS)
    # 6 buckets, cut from the first gradient on (the step's flags ride in the last); Keras 2's
    # fit: Horovod's one allreduce for each of the 24 gradients and one for the flags.
    assert len(task) == 6, list(task)
    assert len(fit) == (25 if KERAS2 else 6), list(fit)
    # Most steps, not each: in a step whose buckets were all enqueued, on every rank, before
    # Horovod's next cycle, nothing overlaps (2 busy cores: a rank may lose its core).
    assert len(overlapped_steps(task, STEPS)) >= STEPS // 2, task
    assert len(overlapped_steps(fit, STEPS)) >= STEPS // 2, fit
