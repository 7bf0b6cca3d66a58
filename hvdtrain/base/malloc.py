"""Huge pages for TensorFlow's buffers: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` for the ranks.

TensorFlow allocates its tensors with glibc's malloc, which does not ask for transparent huge
pages, and Open MPI's shared-memory copies of 4 KiB-page buffers are slow: with the tunable,
Horovod's allreduce was 1.36x / 1.61x / 2.77x faster at 4 / 16 / 64 MiB
(docs/performance/speed.md). glibc reads GLIBC_TUNABLES once, when the process starts, so it
must be in a rank's environment before the rank starts: the launch scripts set it
(scripts/hugetlb.sh mirrors ``tunables()``), and a rank that a bare ``horovodrun`` or
``mpirun`` started without it starts itself again with it (``reexec()``, called first thing
by ``hvdtrain/__init__``).

The decision, in one place (``tunables``): the tunable is added when
- ``HVDTRAIN_HUGETLB`` is not ``0`` (the off switch),
- GLIBC_TUNABLES does not already name ``glibc.malloc.hugetlb`` (a user's value, e.g.
  ``hugetlb=0``, is the user's choice; other tunables are kept and it is appended to them),
- glibc is 2.35 or newer (older glibc has no such tunable) and transparent huge pages are not
  ``[never]`` (/sys/kernel/mm/transparent_hugepage/enabled).

May import: nothing of hvdtrain but ``base.launch``; nothing heavy, since it runs before
anything else of hvdtrain.
"""

from __future__ import annotations

import os
import sys

from hvdtrain.base.launch import several_processes

TUNABLE = "glibc.malloc.hugetlb"
SWITCH = "HVDTRAIN_HUGETLB"  # 0: leave GLIBC_TUNABLES alone
# Set by reexec() to the process id it re-executed: the process (same pid after exec) then
# never does it twice, whatever glibc does with the variable.
MARKER = "HVDTRAIN_HUGETLB_REEXEC"
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)
# Imported before hvdtrain, these make a re-exec cost more than a Python start (their
# imports run again), or show a process that is not a launched script's: a notebook, or a test
# runner (pytest's capture has moved the output's file descriptors: the new process would
# write into its temporary files).
HEAVY = (
    "tensorflow",
    "keras",
    "tf_keras",
    "horovod",
    "torch",
    "jax",
    "IPython",
    "ipykernel",
    "_pytest",
)


def glibc_version() -> tuple | None:
    """The C library's version as (major, minor), None when it is not glibc."""
    try:
        # Not glibc: confstr gives None, and None.split() raises AttributeError (below).
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # type: ignore[union-attr]
        return tuple(int(p) for p in version.split(".")[:2]) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def thp_mode(path: str = THP) -> str | None:
    """Transparent huge pages' mode (always, madvise, never), None without them."""
    try:
        text = open(path).read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def unavailable(glibc, thp) -> str | None:
    """Why a machine with this glibc (``glibc_version()``) and THP mode (``thp_mode()``)
    cannot have the tunable, or None when it can."""
    if glibc is None or glibc < MIN_GLIBC:
        return f"glibc {'.'.join(map(str, glibc))} is older than 2.35" if glibc else "not glibc"
    if thp in (None, "never"):
        return "transparent huge pages are off" if thp else "no transparent huge pages"
    return None


def has_tunable(value: str | None) -> bool:
    """Whether a GLIBC_TUNABLES value sets glibc.malloc.hugetlb, to any value."""
    return any(item.startswith(TUNABLE + "=") for item in (value or "").split(":"))


def tunables(environ=os.environ, machine=None) -> str | None:
    """The GLIBC_TUNABLES a rank started with ``environ`` should have, or None: leave it.
    ``machine``: (glibc, thp) as ``unavailable`` takes them; this machine's by default."""
    value = environ.get("GLIBC_TUNABLES", "")
    if environ.get(SWITCH) == "0" or has_tunable(value):
        return None
    if unavailable(*(machine or (glibc_version(), thp_mode()))):
        return None
    return f"{value}:{TUNABLE}=1" if value else f"{TUNABLE}=1"


# GLIBC_TUNABLES as this process started with it (what glibc read): taken when hvdtrain is
# first imported, before anything of hvdtrain can change it. Not from /proc/self/environ:
# glibc cuts the original string at each ':' when it parses it, and keeps a whole copy.
AT_START = os.environ.get("GLIBC_TUNABLES")


def state(environ=os.environ) -> dict:
    """This machine's and this process's standing, for the doctor: glibc's version, THP's
    mode, why the tunable cannot be had (or None), what a launched rank started from this
    environment gets (GLIBC_TUNABLES, or None: as it is), and what this process started
    with."""
    glibc, thp = glibc_version(), thp_mode()
    return {
        "glibc": ".".join(map(str, glibc)) if glibc else None,
        "thp": thp,
        "unavailable": unavailable(glibc, thp),
        "switch": environ.get(SWITCH),
        "environment": environ.get("GLIBC_TUNABLES"),
        "ranks_get": tunables(environ, (glibc, thp)),
        "this_process": AT_START,
        "this_process_has": huge(AT_START),
    }


def huge(value: str | None) -> bool:
    """Whether a GLIBC_TUNABLES value turns glibc.malloc.hugetlb on (1: THP, 2: hugetlbfs)."""
    return any(
        item.startswith(TUNABLE + "=") and item.split("=", 1)[1] not in ("", "0")
        for item in (value or "").split(":")
    )


def _interactive() -> bool:
    return (
        bool(sys.flags.interactive)
        or hasattr(sys, "ps1")
        or not getattr(sys, "orig_argv", None)  # Python < 3.10, or embedded
        or sys.argv[:1] in ([""], ["-"])
    )  # a REPL, or a program read from stdin


def reexec(environ=os.environ) -> None:
    """Start this rank again, at once, with the tunable, if it is a launched rank without it.

    Only one of several launched processes (a one-process run exchanges no gradients),
    never in an interactive session or a program read from stdin (it could not be read
    again), never once TensorFlow, Horovod or another framework is imported, never twice.

    Safe here: it runs as hvdtrain's first code, before TensorFlow or Horovod is imported and
    before any thread of Python's own starts (threads of a library imported earlier, such
    as OpenBLAS's idle pool under numpy, end with the exec and hold nothing), and the
    program's output so far is flushed: the new process runs the same argv in the same
    environment plus the tunable, with the same process id, so the launcher and MPI see
    the same rank. What a script ran before importing hvdtrain runs again (its imports, its
    argument parsing). Its cost is one interpreter start up to here (docs/reference/
    environment.md gives the figure).
    """
    value = tunables(environ)
    if (
        value is None
        or environ.get(MARKER) == str(os.getpid())
        or not several_processes(environ)
        or _interactive()
        or any(name in sys.modules for name in HEAVY)
    ):
        return
    import threading  # a small module; asking starts nothing

    if threading.active_count() > 1:  # the program's own threads: their work would be lost
        return
    environ[MARKER] = str(os.getpid())
    environ["GLIBC_TUNABLES"] = value
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    # sys.executable, not orig_argv[0]: a bare "python" would be looked up on PATH again.
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
