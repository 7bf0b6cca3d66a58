"""The watchdog's connections: each rank's one TCP connection to rank 0, and its handshake.

``listen`` opens rank 0's socket (loopback when every rank is on its host) and makes the job's
secret; ``handshake_as_rank`` and ``handshake_as_chief`` are the two sides of the
challenge-response each connection starts with (HMAC-SHA256 of fresh nonces, both ways, under
one deadline), so only the job's own ranks get a ``Peer``; ``Lines`` reads a line with a byte
bound and before a deadline, so a sender can neither grow memory nor stretch a time limit.
``watchdog.Watchdog`` uses them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import threading
import time

HANDSHAKE_SECONDS = 10.0  # the whole handshake of one connection
LINE_BYTES = 512  # a handshake line's bound (a HELLO is under 200 bytes)
PEER_LINE_BYTES = 1 << 16  # a rank's line after the handshake (a FAIL carries an error line)
PENDING = 16  # handshakes in flight at once; the job's own ranks connect once each


def mac(secret: bytes, *parts) -> str:
    return hmac.new(secret, "|".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def addresses() -> list:
    """Where other hosts may reach this one, best first: the addresses of the interface the
    launcher was told to use, every other non-loopback IPv4 address, its names, loopback."""
    found = []
    try:
        import psutil  # a Horovod dependency; without it, names only

        preferred = {
            os.environ.get(v)
            for v in ("HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME", "OMPI_MCA_btl_tcp_if_include")
        }
        interfaces = sorted(psutil.net_if_addrs().items(), key=lambda kv: kv[0] not in preferred)
        found += [
            a.address
            for _, addrs in interfaces
            for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")
        ]
    except ImportError:
        pass
    found += [n for n in (os.environ.get("HOROVOD_HOSTNAME"), socket.gethostname()) if n]
    found.append("127.0.0.1")
    return list(dict.fromkeys(found))


class Lines:
    """Lines from a socket, each read with a byte bound and before a deadline: what a
    ``makefile().readline()`` does, but a sender without newlines cannot grow it without
    bound, nor a slow one stretch a time limit that each receive would restart."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, b""

    def readline(self, limit: int, deadline: float | None = None) -> str | None:
        """The next line (with its newline); "" at the end of the stream; None when it is
        longer than ``limit`` bytes or the deadline passes first."""
        while b"\n" not in self.buffer:
            if len(self.buffer) > limit:
                return None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(4096)
            except TimeoutError:
                return None
            if not chunk:
                return ""
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        if len(line) > limit:
            return None
        return line.decode(errors="replace") + "\n"


class Peer:
    """A connected, authenticated rank (rank 0, seen from a rank): its socket, its lines,
    when it was last heard from."""

    def __init__(self, sock: socket.socket, stream: Lines, rank: int, host: str, pid: str):
        self.sock, self.stream, self.rank, self.host, self.pid = sock, stream, rank, host, pid
        self.last_seen, self.step, self.done = time.monotonic(), 0, False
        self.lock = threading.Lock()

    def send(self, line: str) -> bool:
        try:
            with self.lock:
                self.sock.sendall((line + "\n").encode())
            return True
        except OSError:
            return False  # the reader notices the broken connection

    def __str__(self):
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


# --- the handshake: each side proves it knows the job's secret (HMAC of fresh nonces) -----------


def listen(world):
    """Rank 0: (its listening socket, what the ranks need to reach it: addresses, port,
    host name and the job's secret). One host (every rank local): loopback only. Several:
    every interface, unless HVDTRAIN_WATCHDOG_ADDR names the one the ranks use."""
    one_host = world.local_size == world.size
    bind = "127.0.0.1" if one_host else os.environ.get("HVDTRAIN_WATCHDOG_ADDR", "")
    port = int(os.environ.get("HVDTRAIN_WATCHDOG_PORT", "0") or 0)
    try:
        server = socket.create_server((bind, port), backlog=max(world.size, PENDING))
    except OSError as e:
        # Said on every rank (the ranks wait for the address in the broadcast below).
        return None, (
            "error",
            f"HVDTRAIN_WATCHDOG_PORT={port}: rank 0 cannot listen on "
            f"{bind or 'every interface'}:{port} "
            f"({os.strerror(e.errno) if e.errno else e}): another "
            "process holds it; free it, choose another port, or unset "
            "HVDTRAIN_WATCHDOG_PORT for a free one",
        )
    return server, (
        ["127.0.0.1"] if one_host else addresses(),
        server.getsockname()[1],
        socket.gethostname(),
        secrets.token_bytes(32),
    )


def handshake_as_rank(sock, secret: bytes, rank: int) -> Peer | None:
    """A rank's side: answer rank 0's challenge, check its answer to ours."""
    deadline = time.monotonic() + HANDSHAKE_SECONDS
    stream = Lines(sock)
    try:
        challenge = (stream.readline(LINE_BYTES, deadline) or "").split()
        if len(challenge) != 2 or challenge[0] != "CHALLENGE":
            return None
        mine = secrets.token_hex(16)
        me = (rank, os.getpid(), socket.gethostname())
        sock.sendall(
            (
                f"HELLO {me[0]} {me[1]} {me[2]} {mine} "
                f"{mac(secret, 'rank', challenge[1], *me, mine)}\n"
            ).encode()
        )
        reply = (stream.readline(LINE_BYTES, deadline) or "").split()
        if (
            len(reply) != 4
            or reply[0] != "WELCOME"
            or not hmac.compare_digest(reply[3], mac(secret, "rank0", mine, reply[1], reply[2]))
        ):
            return None
    except (OSError, ValueError):
        return None
    return Peer(sock, stream, 0, reply[2], reply[1])


def handshake_as_chief(sock, secret: bytes, size: int) -> Peer | None:
    """Rank 0's side: challenge the caller; welcome it (answering its challenge) only if it
    is a rank of this job. None for anything else."""
    deadline = time.monotonic() + HANDSHAKE_SECONDS
    sock.settimeout(HANDSHAKE_SECONDS)
    stream = Lines(sock)
    nonce = secrets.token_hex(16)
    try:
        sock.sendall(f"CHALLENGE {nonce}\n".encode())
        hello = (stream.readline(LINE_BYTES, deadline) or "").split()
        if not (
            len(hello) == 6
            and hello[0] == "HELLO"
            and hmac.compare_digest(hello[5], mac(secret, "rank", nonce, *hello[1:5]))
        ):
            return None
        rank = int(hello[1])
    except (OSError, ValueError):
        return None
    if not 0 < rank < size:
        return None
    me = (os.getpid(), socket.gethostname())
    peer = Peer(sock, stream, rank, hello[3], hello[2])
    peer.send(f"WELCOME {me[0]} {me[1]} {mac(secret, 'rank0', hello[4], *me)}")
    return peer
