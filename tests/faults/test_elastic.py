"""Elastic training on one machine: a worker killed mid-run, a worker added mid-run; the
Task path's --elastic, and Horovod's own elastic Keras fit (tests/elastic_keras_script.py)."""

import json
import os
import re
import signal
import socket
import sys

import pytest

from conftest import (
    HOROVODRUN,
    ROOT,
    as_printed,
    checkout_like,
    finish,
    module_cmd,
    rank_pids,
    result,
    run,
    start,
    wait_for,
)
from docs_pages import block

EPOCHS, COMMIT = 30, 20
# Two workers train an epoch in about 0.3 s here (TensorFlow 2.21): 10 epochs could end
# before a kill after the second one lands. A host added to the file reaches the worker only
# when Horovod's driver next runs the discovery script (each second, in a spawned process)
# and notifies it; the worker then waits at its next commit for the new one to start. On a
# loaded CI machine that notice once took longer than 30 one-worker epochs, and the run
# ended with one worker: 100 epochs leave it about 17 s at the one-worker pace (the test
# costs about 20 s more for it).
JOIN_EPOCHS = 100


def elastic_cmd(np, run_dir, epochs=EPOCHS):
    # --network-interface lo: without it the driver waits for a second NIC forever.
    return [
        HOROVODRUN,
        "-np",
        str(np),
        "--min-np",
        "1",
        "--max-np",
        "2",
        "--host-discovery-script",
        os.path.join(ROOT, "scripts", "discover_hosts.sh"),
        "--network-interface",
        "lo",
        sys.executable,
        "-m",
        "hvdtrain.linear",
        "--elastic",
        "--run-dir",
        str(run_dir),
        "--batch-size",
        "5",
        "--epochs",
        str(epochs),
        "--learning-rate",
        "0.0005",
        "--commit-every",
        str(COMMIT),
        "--verbose",
        "2",
    ]


def run_with(cmd, env, action):
    """Start the elastic job, do ``action()`` to it while it runs, wait for it to end."""
    proc = start(cmd, env)
    try:
        action()
        return finish(proc, 240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def epochs_logged(run_dir):
    return [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_killed_worker_survivor_finishes_from_last_commit(env, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")  # two names: a failure blacklists one
    env = dict(env, HVDTRAIN_HOSTS_FILE=str(hosts))
    run_dir = tmp_path / "run"

    def kill_one():
        pids = wait_for(lambda: (lambda d: d if len(d) == 2 else None)(rank_pids(str(run_dir))), 90)
        # Two epochs logged: the commit at the end of the first is certainly made.
        assert pids and wait_for(
            lambda: (run_dir / "metrics.jsonl").exists() and len(epochs_logged(run_dir)) >= 2, 90
        )
        os.kill(pids[1], signal.SIGKILL)

    rc, out, err = run_with(elastic_cmd(2, run_dir), env, kill_one)
    assert rc == 0, err
    r = result(run_dir)
    assert r["world_size"] == 1 and r["epochs"] == EPOCHS
    logged = epochs_logged(run_dir)
    assert [e["epoch"] for e in logged] == list(range(1, EPOCHS + 1))
    assert logged[0]["world_size"] == 2 and logged[-1]["world_size"] == 1
    # The survivor rolled back to a commit made after the first epoch, not to step 0 ...
    resumed = int(re.search(r"resumed at epoch \d+, step (\d+)", err).group(1))
    assert resumed >= 100 and resumed % COMMIT == 0
    # ... and then trained exactly the rest: the examples after that commit, on its own.
    epoch, offset = divmod(resumed * 10, 1000)
    assert r["global_step"] == resumed + (1000 - offset) // 5 + (EPOCHS - epoch - 1) * 200


def test_added_worker_joins_and_the_run_finishes_with_two(env, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    env = dict(env, HVDTRAIN_HOSTS_FILE=str(hosts))
    run_dir = tmp_path / "run"

    def add_one():
        assert wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 90)
        hosts.write_text("localhost:1\n127.0.0.1:1\n")

    rc, out, err = run_with(elastic_cmd(1, run_dir, JOIN_EPOCHS), env, add_one)
    assert rc == 0, err
    r = result(run_dir)
    assert r["world_size"] == 2 and r["global_batch_size"] == 10, err[-3000:]
    logged = epochs_logged(run_dir)
    assert [e["epoch"] for e in logged] == list(range(1, JOIN_EPOCHS + 1))
    assert logged[0]["world_size"] == 1 and logged[-1]["world_size"] == 2


def test_the_faults_guides_elastic_command_as_printed(env, tmp_path):
    """The Preemption and faults guide's elastic command, run as printed in a checkout: with
    no hosts file, scripts/discover_hosts.sh names this machine twice and the two workers
    train every epoch together."""
    (line,) = block("guides/faults.md", "horovodrun -np 2 --min-np 1 --max-np 2").commands()
    assert "HVDTRAIN_HOSTS_FILE" not in env
    cwd = checkout_like(tmp_path / "checkout")
    p = run(as_printed(line), env, timeout=180, cwd=str(cwd))
    assert p.returncode == 0, p.stderr[-3000:]
    run_dir = cwd / "runs" / "elastic"
    r = result(run_dir)
    assert (r["task"], r["world_size"], r["ranks_identical"]) == ("mnist", 2, True)
    assert r["global_step"] == 10 * 4000 // 200 and 0.5 < r["test_accuracy"] <= 1.0
    assert json.load(open(run_dir / "config.json"))["elastic"] is True
    assert [(e["epoch"], e["world_size"]) for e in epochs_logged(run_dir)] == [
        (epoch, 2) for epoch in range(1, 11)
    ]
    assert "Horovod over gloo" in p.stdout and "resumed" not in p.stderr


def test_elastic_needs_a_run_dir(env):
    p = run(module_cmd("linear", "--elastic"), env, timeout=60)
    assert p.returncode == 2 and "--elastic=True: needs --run-dir" in p.stderr


@pytest.mark.keras2
@pytest.mark.timeout(300)
def test_horovod_elastic_keras_fit_survives_a_kill_and_takes_a_worker_back(env, tmp_path):
    """Horovod's KerasState and its callbacks in fit, 2 workers: the one on 127.0.0.1 dies
    mid-epoch (SIGKILL), the survivor goes on alone from its last commit, a host is added
    (this machine under a third name), its worker joins with the survivor's weights, and
    the job ends with both on the same committed state."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")  # a failure blacklists its host's name
    log = tmp_path / "log.jsonl"
    script = os.path.join(ROOT, "tests", "elastic_keras_script.py")
    cmd = [
        HOROVODRUN,
        "-np",
        "2",
        "--min-np",
        "1",
        "--max-np",
        "2",
        "--host-discovery-script",
        os.path.join(ROOT, "scripts", "discover_hosts.sh"),
        "--network-interface",
        "lo",
        sys.executable,
        script,
        str(log),
        str(tmp_path / "killed"),
    ]

    def lines():
        return [json.loads(l) for l in open(log)] if log.exists() else []

    def add_one():
        # Once the survivor is alone (its reset at size 1), a third name for this machine.
        assert wait_for(
            lambda: any(e["event"] == "reset" and e["size"] == 1 for e in lines()), 180
        ), "no reset to one worker"
        hosts.write_text(f"localhost:1\n127.0.0.1:1\n{socket.gethostname()}:1\n")

    rc, out, err = run_with(cmd, dict(env, HVDTRAIN_HOSTS_FILE=str(hosts)), add_one)
    assert rc == 0, err[-3000:]
    events = lines()
    by_pid = {}
    for e in events:
        by_pid.setdefault(e["pid"], []).append(e)
    killed = [
        p
        for p, es in by_pid.items()
        if es[0]["start_rank"] == 1
        and es[0]["size"] == 2
        and not any(e["event"] == "end" for e in es)
    ]
    assert len(killed) == 1, "the worker on 127.0.0.1 did not die once"
    survivor = next(p for p, es in by_pid.items() if es[0]["start_rank"] == 0)
    s = by_pid[survivor]
    # The survivor's reset to one worker restored its last commit before the failure:
    # mid-epoch 1, the weights exactly.
    first_reset = next(i for i, e in enumerate(s) if e["event"] == "reset")
    assert s[first_reset]["size"] == 1
    last_commit = [e for e in s[:first_reset] if e["event"] == "commit"][-1]
    assert (last_commit["epoch"], last_commit["batch"]) == (1, 3)
    assert (s[first_reset]["epoch"], s[first_reset]["batch"]) == (1, 3)
    assert s[first_reset]["weights"] == last_commit["weights"]
    # It trained on alone, then a new worker joined with its weights.
    alone = [e for e in s[first_reset:] if e["event"] == "commit" and e["size"] == 1]
    assert alone, "the survivor did not train alone"
    added = [p for p in by_pid if p not in (survivor, *killed)]
    assert len(added) == 1, f"{len(added)} workers joined"
    joined = by_pid[added[0]][0]
    assert joined["event"] == "train" and joined["size"] == 2
    synced = next(e for e in s[first_reset:] if e["event"] == "train" and e["size"] == 2)
    assert joined["weights"] == synced["weights"]
    assert (joined["epoch"], joined["batch"]) == (synced["epoch"], synced["batch"])
    # The end: both with the same committed state, all epochs done.
    ends = [by_pid[p][-1] for p in (survivor, added[0])]
    assert all(e["event"] == "end" and e["size"] == 2 and e["epoch"] == 6 for e in ends)
    assert ends[0]["weights"] == ends[1]["weights"]
    commits = [[e for e in by_pid[p] if e["event"] == "commit"][-1] for p in (survivor, added[0])]
    assert commits[0]["weights"] == commits[1]["weights"] == ends[0]["weights"]
