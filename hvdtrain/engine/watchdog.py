"""A peer watchdog: no rank waits forever on a dead or frozen peer, whatever the controller.

Horovod's collectives have no timeout under MPI, and a frozen rank (SIGSTOP, a hung
filesystem) keeps its sockets open, so a peer's failure can block everyone else forever.
Each rank therefore keeps one TCP connection to rank 0, outside Horovod, over which both
sides send a heartbeat every second from a background thread:

- a connection that closes without a goodbye: that rank died;
- no heartbeat for ``timeout`` seconds: that rank is frozen or stalled;
- rank 0 prints the verdict, one line naming the rank, its host and pid (or a rank's own
  error, which that rank sends it), relays it ("ABORT STATUS ...") to every rank, and every
  rank exits with status 69 (EXIT_PEER_LOST: the infrastructure's, retried by a cluster's
  launcher) for a rank that died or froze, 1 for a rank's own error; the line is said once,
  by rank 0 (by a rank that finds rank 0 itself gone).

The heartbeat runs in its own thread, so a slow step (or a long checkpoint write) never
looks like a failure; only a process that cannot run at all, or is gone, does.

Only the job's own ranks can talk to it. Rank 0 listens on loopback when every rank is on
its host (else on all interfaces, or HVDTRAIN_WATCHDOG_ADDR), on HVDTRAIN_WATCHDOG_PORT or a
free port, and makes a 32-byte secret per job that reaches the ranks through Horovod's own
broadcast (never a file, an argument or an environment variable). Each connection starts
with a challenge-response in both directions (HMAC-SHA256 of fresh nonces): a connection
that cannot answer is closed and ignored, so a process that knows the port can neither stop
the job nor pose as a rank or as rank 0; the handshake of each connection runs in its own
thread with a time limit, so nor can it delay the ranks' own connections.

Nor can an outsider grow rank 0's memory or flood its console: a handshake line is read with
a byte bound (``LINE_BYTES``) and the whole handshake with one deadline (not one per
receive); at most ``PENDING`` handshakes run at once (more connections are closed at once);
refused connections are counted and said in at most one line a minute (``WARN_EVERY``), and
once more at the end if any went unsaid. ``HVDTRAIN_WATCHDOG_PORT`` naming a port that
another process holds is one line on every rank (exit 2), before training.
The connections and their handshake are ``watchdog_link``'s.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from hvdtrain.base.errors import EXIT_FAILED, EXIT_PEER_LOST, EnvError
from hvdtrain.engine.watchdog_link import (
    PEER_LINE_BYTES,
    PENDING,
    Peer,
    handshake_as_chief,
    handshake_as_rank,
    listen,
)

INTERVAL = 1.0
WARN_EVERY = 60.0  # seconds between two lines about refused connections


class Watchdog:
    """Start with ``Watchdog(world, timeout).start()``; end with ``close()`` or ``abort()``."""

    def __init__(self, world, timeout: float):
        self.world, self.timeout = world, timeout
        self.step = 0  # the training loop updates it; it goes into heartbeats and messages
        self.peers: dict[int, Peer] = {}
        self._closing = threading.Event()
        self._failed = threading.Lock()
        self._server: socket.socket | None = None
        self._pending = threading.BoundedSemaphore(PENDING)  # handshakes in flight
        self._refused: dict[str, int] = {}  # source address: refusals not yet said
        self._refusals_said = -WARN_EVERY  # when a line about them was last printed
        self._refusals_lock = threading.Lock()

    # --- life cycle -----------------------------------------------------------------------
    def start(self) -> Watchdog:
        if self.world.size == 1 or self.timeout <= 0:
            return self
        server, where = listen(self.world) if self.world.is_chief else (None, None)
        # Horovod: the per-job secret travels with the address, inside the job only.
        where = self.world.broadcast_object(where)
        if where[0] == "error":  # rank 0 could not listen: every rank says it
            raise EnvError(where[1])
        addresses, port, host, self._secret = where
        if host == socket.gethostname() and "127.0.0.1" not in addresses:
            addresses = ["127.0.0.1"] + addresses  # the same machine: try loopback first
        if self.world.is_chief:
            threading.Thread(target=self._accept, args=(server,), daemon=True).start()
        else:
            peer = self._connect(addresses, port)
            if peer is None:
                self._warn(
                    f"rank 0's watchdog unreachable at {addresses}:{port}; "
                    "continuing without dead-peer detection on this rank"
                )
                return self
            self.peers[0] = peer
            threading.Thread(target=self._read, args=(peer,), daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()
        return self

    def close(self) -> None:
        """A normal end (or an error every rank shares): say goodbye, stop watching."""
        self._closing.set()
        self._stop_listening()
        for peer in list(self.peers.values()):
            peer.send("BYE")
        self._say_refusals(final=True)

    def await_verdict(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the watchdog to judge a failure (it then ends this
        process with its one line); return at once if it is not running."""
        if self.peers:
            self._closing.wait(seconds)
            time.sleep(0.5 if self._closing.is_set() else 0)  # let _fail finish exiting

    def abort(self, message: str) -> bool:
        """This rank failed alone: make every rank stop rather than wait for it. True when
        rank 0 says ``message`` (the error of another rank); False when this rank must say
        it (rank 0, or nobody to tell)."""
        message = " ".join(message.split())  # one line on the wire
        if not self.peers:
            return False  # not started (one process, or --peer-timeout 0): nobody to tell
        if self.world.is_chief:
            self._fail(message, exit_now=False, show=False, status=EXIT_FAILED)
            return False
        if 0 in self.peers and self.peers[0].send(f"FAIL {message}"):
            self._closing.set()
            return True
        return False

    # --- threads --------------------------------------------------------------------------
    def _connect(self, addresses, port) -> Peer | None:
        """A rank: connect to rank 0 and prove, both ways, that we share the job's secret."""
        deadline = time.monotonic() + max(self.timeout, 10.0)
        while time.monotonic() < deadline:
            for address in addresses:
                try:
                    sock = socket.create_connection((address, port), timeout=1.0)
                except OSError:
                    continue
                peer = handshake_as_rank(sock, self._secret, self.world.rank)
                if peer is not None:
                    return peer
                sock.close()  # not rank 0 of this job (or it hung up): keep looking
            time.sleep(0.5)
        return None

    def _accept(self, server: socket.socket) -> None:
        """Rank 0: admit each rank that proves it knows the secret; refuse everything else,
        for the whole run (the port stays open: a refusal is then what anyone else gets,
        not a race with the ranks' own connections)."""
        self._server = server
        while not self._closing.is_set():
            try:
                sock, source = server.accept()
            except OSError:
                return  # closed by close() or _fail()
            if not self._pending.acquire(blocking=False):  # a flood: no thread, no read
                sock.close()
                self._refuse(source[0])
                continue
            threading.Thread(target=self._admit, args=(sock, source), daemon=True).start()

    def _admit(self, sock, source) -> None:
        try:
            peer = handshake_as_chief(sock, self._secret, self.world.size)
        finally:
            self._pending.release()
        if peer is None or peer.rank in self.peers:
            sock.close()
            self._refuse(source[0])
            return
        self.peers[peer.rank] = peer
        threading.Thread(target=self._read, args=(peer,), daemon=True).start()

    def _refuse(self, source: str) -> None:
        with self._refusals_lock:
            self._refused[source] = self._refused.get(source, 0) + 1
        self._say_refusals()

    def _say_refusals(self, final: bool = False) -> None:
        """At most one line a minute about refused connections (and the rest at the end)."""
        with self._refusals_lock:
            now = time.monotonic()
            if not self._refused or (not final and now - self._refusals_said < WARN_EVERY):
                return
            refused, self._refused, self._refusals_said = self._refused, {}, now
        n = sum(refused.values())
        sources = ", ".join(
            f"{a} ({c})" if c > 1 and len(refused) > 1 else a for a, c in sorted(refused.items())
        )
        self._warn(
            f"watchdog: refused {'a connection' if n == 1 else f'{n} connections'} "
            f"from {sources}: not a rank of this job"
            + ("" if final else f" (the next such line in {WARN_EVERY:.0f} s at the earliest)")
        )

    def _read(self, peer: Peer) -> None:
        stream = peer.stream
        peer.sock.settimeout(None)
        while True:
            try:
                line = stream.readline(PEER_LINE_BYTES) or ""
            except OSError:
                line = ""
            if not line:
                if not (peer.done or self._closing.is_set()):
                    self._fail(f"{peer} died: its connection closed at step {self.step}")
                return
            kind, _, rest = line.rstrip("\n").partition(" ")
            peer.last_seen = time.monotonic()
            if kind == "HB":
                peer.step = int(rest or 0)
            elif kind == "BYE":
                peer.done = True
            elif kind == "FAIL":  # to rank 0 from a rank that failed on its own
                self._fail(rest, status=EXIT_FAILED)
            elif kind == "ABORT":  # from rank 0: the verdict (its status first), said there
                status, _, rest = rest.partition(" ")
                self._fail(
                    rest,
                    relay=False,
                    show=False,
                    status=int(status) if status.isdigit() else EXIT_PEER_LOST,
                )

    def _beat(self) -> None:
        while not self._closing.wait(INTERVAL):
            self._say_refusals()  # what was refused since the last line, once a minute
            now = time.monotonic()
            for peer in list(self.peers.values()):
                peer.send(f"HB {self.step}")
                if not peer.done and now - peer.last_seen > self.timeout:
                    self._fail(
                        f"{peer} stopped answering: no heartbeat for "
                        f"{now - peer.last_seen:.0f} s (frozen or stalled) at step "
                        f"{self.step}"
                    )

    def _stop_listening(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def _fail(
        self,
        message: str,
        relay: bool = True,
        exit_now: bool = True,
        show: bool = True,
        status: int = EXIT_PEER_LOST,
    ) -> None:
        """The verdict: ``status`` is every rank's exit status, 69 (EXIT_PEER_LOST) when a
        rank died or froze (its node, usually: retried), 1 when a rank failed on its own
        (its error is the run's: the user's to fix)."""
        if not self._failed.acquire(blocking=False):
            return
        self._closing.set()
        self._stop_listening()
        if relay and self.world.is_chief:
            for peer in list(self.peers.values()):
                peer.send(f"ABORT {status} {message}")
        if show:  # each message names the rank it is about
            sys.stderr.write(f"hvdtrain: error: {message}\n")
            sys.stderr.flush()
        if exit_now:
            # The main thread is blocked inside a collective that will never complete.
            os._exit(status)

    def _warn(self, message: str) -> None:
        sys.stderr.write(f"hvdtrain: warning: {message}\n")
        sys.stderr.flush()
