"""The peer watchdog under hostile conditions: a foreign process that knows its port, a flood
of connections and a line without end, a port already in use (one line, nothing written),
on 2 ranks through the Task path and hk.fit."""

import json
import os
import re
import signal

import pytest

from conftest import finish, launch, rank_pids, run, start, wait_for

# A linear run long enough to act on while it trains (2 ranks, 40 epochs of small steps).
LONG = [
    "--batch-size",
    "5",
    "--epochs",
    "40",
    "--learning-rate",
    "0.0005",
    "--verbose",
    "2",
    "--checkpoint-every",
    "50",
]


def listening_address(port):
    """The local address a TCP socket listens on at ``port`` (from /proc/net/tcp)."""
    import socket as S
    import struct

    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, p = local.split(":")
        if int(p, 16) == port and state == "0A":  # LISTEN
            return S.inet_ntoa(struct.pack("<I", int(address, 16)))
    return None


def test_the_watchdog_ignores_a_foreign_process_that_knows_its_port(env, tmp_path):
    """Anyone on the machine can connect to the port; only the job's ranks are heard."""
    import socket as S

    with S.socket() as probe:  # a free port, given to the watchdog so that the test knows it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_dir = tmp_path / "run"
    proc = start(
        launch("gloo", 2, "linear", "--run-dir", str(run_dir), *LONG[:-2]),
        dict(env, HVDTRAIN_WATCHDOG_PORT=str(port)),
    )
    held = []
    try:
        assert wait_for(lambda: (run_dir / "config.json").exists(), 120), "job did not start"
        assert listening_address(port) in (None, "127.0.0.1")  # one host: loopback only
        forged = [
            # hvdtrain 0.1's protocol: a rank's hello, then the message that stops the job
            b"HELLO 1 4242 attacker\nFAIL rank 1 failed: forged\n",
            # the current protocol with a guessed MAC, then the verdict rank 0 would relay
            b"HELLO 1 4242 attacker " + b"0" * 32 + b" " + b"f" * 64 + b"\nABORT forged\n",
            b"ABORT forged\nBYE\n",
        ]
        challenged = 0
        for payload in forged:
            s = S.create_connection(("127.0.0.1", port), timeout=5)  # open all run long
            held.append(s)
            challenged += s.recv(100).startswith(b"CHALLENGE ")
            s.sendall(payload)
        # ... and one that connects and says nothing, holding its connection open.
        held.append(S.create_connection(("127.0.0.1", port), timeout=5))
        rc, out, err = finish(proc, 240)
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            finish(proc, 30)
    assert rc == 0, err[-3000:]
    assert challenged == len(forged)  # each attempt reached the handshake ...
    # ... and failed: the first refusal in a line at once, the rest counted in one more line
    # at the end (at most one line a minute); the silent one among them if its handshake's
    # 10 s ran out before the job's end
    refusals = [l for l in err.splitlines() if "watchdog: refused" in l]
    assert (
        "hvdtrain: warning: watchdog: refused a connection from 127.0.0.1: not a rank of "
        "this job (the next such line in 60 s at the earliest)"
    ) in refusals[0], refusals
    counted = [int(m) for l in refusals for m in re.findall(r"refused (\d+) connections", l)]
    assert len(refusals) <= 2 and 1 + sum(counted) in (len(forged), len(forged) + 1), refusals
    assert "forged" not in err, err[-3000:]
    assert json.load(open(run_dir / "result.json"))["ranks_identical"] is True


def _rss_mb(pid, field="VmRSS"):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":")) / 1024


class PeakMemory:
    """Rank 0's peak resident memory (VmHWM, MB) over a job's life: read every 0.1 s from
    the moment the rank is found until ``close()`` (after the job's end: its last reading)."""

    def __init__(self, run_dir):
        import threading

        self.mb, self.done = 0.0, threading.Event()
        self.thread = threading.Thread(target=self._watch, args=(str(run_dir),), daemon=True)
        self.thread.start()

    def _watch(self, run_dir):
        pid = None
        while not self.done.is_set():
            pid = pid or rank_pids(run_dir).get(0)
            if pid:
                try:
                    self.mb = max(self.mb, _rss_mb(pid, "VmHWM"))
                except (OSError, StopIteration):  # it has ended
                    return
            self.done.wait(0.1)

    def close(self):
        self.done.set()
        self.thread.join(10)
        return self.mb


def test_the_watchdog_holds_against_a_flood_and_a_line_without_end(env, tmp_path):
    """100 MB sent without a newline, then 500 connections: rank 0's memory does not grow by
    what was sent (its peak within 50 MB of the same job's in quiet), the job ends with its
    normal result, and a few lines say what happened."""
    import socket as S
    import threading

    with S.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_dir = tmp_path / "run"
    # Long enough for the attack (a few seconds) on a slow machine: 2.5 times LONG's epochs.
    args = [*LONG[: LONG.index("--epochs") + 1], "100", *LONG[LONG.index("--epochs") + 2 : -2]]
    env = dict(env, HVDTRAIN_WATCHDOG_PORT=str(port))
    # The same job in quiet, nobody at its port, for a fifth of the epochs: its memory is
    # level after the first (a longer run could only hold more, which makes the bound
    # below stricter, not looser).
    quiet_dir = tmp_path / "quiet"
    short = [*args[: args.index("--epochs") + 1], "20", *args[args.index("--epochs") + 2 :]]
    proc = start(launch("gloo", 2, "linear", "--run-dir", str(quiet_dir), *short), env)
    peak = PeakMemory(quiet_dir)
    rc, _, err = finish(proc, 240)
    quiet = peak.close()
    assert rc == 0 and quiet > 0, err[-3000:]
    proc = start(launch("gloo", 2, "linear", "--run-dir", str(run_dir), *args), env)
    peak = PeakMemory(run_dir)
    try:
        assert wait_for(lambda: (run_dir / "config.json").exists(), 120), "job did not start"
        pids = wait_for(
            lambda: rank_pids(str(run_dir)) if len(rank_pids(str(run_dir))) == 2 else None, 30
        )
        before = _rss_mb(pids[0])
        sent = [0]

        def pour():  # 100 MB, no newline, as fast as rank 0 takes it
            chunk = b"x" * (1 << 20)
            try:
                with S.create_connection(("127.0.0.1", port), timeout=20) as s:
                    for _ in range(100):
                        s.sendall(chunk)
                        sent[0] += len(chunk)
            except OSError:
                pass  # rank 0 hung up: what it should do

        pourer = threading.Thread(target=pour)
        pourer.start()
        pourer.join(60)
        assert proc.poll() is None, "the job ended before the attack did: make it longer"
        grown = _rss_mb(pids[0]) - before
        flood = []  # 500 connections that never speak, from 10 threads, closed at once

        def connect(n):
            for _ in range(n):
                try:
                    flood.append(S.create_connection(("127.0.0.1", port), timeout=0.5))
                except OSError:
                    pass  # the backlog is full: dropped by the kernel, not by rank 0

        threads = [threading.Thread(target=connect, args=(50,)) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for s in flood:
            s.close()
        assert proc.poll() is None, "the job ended before the flood did: make it longer"
        rc, out, err = finish(proc, 240)
    finally:
        attacked = peak.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            finish(proc, 30)
    assert rc == 0, err[-3000:]
    assert sent[0] < 100 << 20  # rank 0 closed the endless line ...
    assert grown < 50, f"rank 0 grew by {grown:.0f} MB"  # ... without keeping it
    print(f"rank 0's peak memory: {attacked:.0f} MB attacked, {quiet:.0f} MB in quiet")
    assert attacked - quiet < 50, f"rank 0's peak: {attacked:.0f} MB, in quiet {quiet:.0f} MB"
    assert len(flood) >= 100  # many more than the handshakes rank 0 runs at once (16)
    refusals = [l for l in err.splitlines() if "watchdog: refused" in l]
    assert 1 <= len(refusals) <= 3, refusals
    assert json.load(open(run_dir / "result.json"))["ranks_identical"] is True


FIT_ONE_EPOCH = """
import sys
import numpy as np
import hvdtrain.keras as hk
from hvdtrain.compat import keras
hk.init()
k = keras()
x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
y = x.sum(axis=1, keepdims=True)
model = k.Sequential([k.Input((3,)), k.layers.Dense(1)])
model.compile(optimizer=hk.DistributedOptimizer(k.optimizers.SGD(0.1)), loss="mse",
              jit_compile=False)
try:
    hk.fit(model, hk.dataset(x, y, batch_size=8), epochs=1, run_dir=sys.argv[1])
except hk.Error as e:
    sys.exit(hk.report_error(e))
"""


@pytest.mark.parametrize("path", ["task", "fit"])
def test_a_watchdog_port_in_use_is_one_line_and_nothing_written(path, env, tmp_path):
    import socket as S

    from usercode import env_with, two_ranks, write

    holder = S.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    run_dir = tmp_path / "run"
    try:
        if path == "task":
            p = run(
                launch("gloo", 2, "linear", "--run-dir", str(run_dir), "--epochs", "1"),
                dict(env, HVDTRAIN_WATCHDOG_PORT=str(port)),
            )
        else:
            code = write(tmp_path, {"fit_one": FIT_ONE_EPOCH})
            p = run(
                two_ranks(code / "fit_one.py", run_dir),
                env_with(code, tmp_path, HVDTRAIN_WATCHDOG_PORT=str(port)),
            )
    finally:
        holder.close()
    lines = [l for l in (p.stdout + p.stderr).splitlines() if "HVDTRAIN_WATCHDOG_PORT" in l]
    assert p.returncode == 1, p.stderr[-3000:]  # horovodrun's status for a failed rank
    assert "exit with status code 2" in p.stdout + p.stderr  # the ranks': a bad setting
    assert len(lines) == 1, lines  # said once, by rank 0
    assert (
        f"HVDTRAIN_WATCHDOG_PORT={port}: rank 0 cannot listen on 127.0.0.1:{port} "
        "(Address already in use): another process holds it"
    ) in lines[0]
    assert not run_dir.exists() or not any(run_dir.iterdir())
