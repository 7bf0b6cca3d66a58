"""Where a run's wall time goes: seconds per phase, from the launch to result.json.

    from hvdtrain.base import timings
    with timings.phase("data"):
        ...                         # counted as data, less any phase opened inside it
    timings.report()                # {"launcher": s, ..., "other": s, "wall": s, ...}

One clock per process. Time counts for the innermost phase open; outside every phase it is
the program's own (``script``); inside a run (``train()``, ``hk.fit``) it is ``other``
unless a named phase holds it. So the phases add up to the wall time by construction, and
``other`` is what no named phase claims: small when the phases cover the run.

``wall`` runs from the launch's start to the moment result.json is written (what comes
after, the process's exit, is not in it). The start is that of the launcher on this host
(``horovodrun``, ``mpirun``, ``mpiexec``, ``orted``, ...: the farthest such ancestor of this
process within a few generations) or, without one, this process's own. Linux gives a
process's start in /proc/PID/stat (field 22: clock ticks since boot, 10 ms each), on the
clock ``CLOCK_BOOTTIME`` reads now; both are compared on it. Rank 0's clock goes into
result.json (it writes the file): the phases before the first step are each rank's own,
and rank 0's ``horovod_init`` and ``agreement`` include its waits for slower ranks.
Where /proc is missing (not Linux), the wall starts at hvdtrain's first code.

The first imports of TensorFlow, Keras and Horovod's TensorFlow module are counted as
``imports`` wherever they happen (a finder on ``sys.meta_path`` times their execution), and
the same finder defers what they import that a run never uses (matplotlib: ``DEFERRED``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import os
import sys
import threading
import time

from hvdtrain.base.importhooks import WrappedLoader, WrappingFinder

# Every phase, in the order of a run, and what it counts (docs/reference/run-directory.md,
# docs/performance/startup.md).
PHASES = {
    "launcher": "the launcher's own start before this process began (horovodrun's, "
    "mpirun's): 0 without one",
    "startup": "this process's start to hvdtrain's first code: the interpreter, and what "
    "the program ran before importing hvdtrain",
    "imports": "hvdtrain's modules; TensorFlow, Keras and Horovod's, wherever first imported",
    "script": "the program's own code outside hvdtrain's calls: the command line; a fit "
    "script's data and model before hk.fit",
    "horovod_init": "hvd.init() (it waits for every rank to reach it), devices and thread pools",
    "agreement": "the ranks agreeing: the run directory, the watchdog's handshake, the "
    "checks' error agreement, preflight, rank 0's state broadcast",
    "data": "loading, checking, sharding and counting the training data",
    "model": "the model, the optimizer's slots, the metrics, the step's setup and its check "
    "on two examples",
    "first_call": "the first compiled call: tracing the training step, its first steps",
    "training": "every other training call, the epochs' sums and stop checks",
    "evaluation": "the test set or validation_data scored, its step's tracing included",
    "checkpoints": "finding and restoring the newest checkpoint, every save",
    "model_save": "model.keras (rank 0)",
    "results": "config.json, metrics.jsonl and TensorBoard each epoch, the weights' "
    "agreement, result.json",
    "other": "the run's time no phase above claims",
}
OUTSIDE, INSIDE = "script", "other"  # the time in no phase: before/after a run, in a run
LAUNCHERS = (
    "horovodrun",
    "mpirun",
    "mpiexec",
    "mpiexec.hydra",
    "orterun",
    "prterun",
    "orted",
    "prted",
    "hydra_pmi_proxy",
)
GENERATIONS = 6  # horovodrun --gloo: rank, sh -c, its spawned helper, horovodrun
IMPORTED = ("tensorflow", "keras", "tf_keras", "horovod.tensorflow")
# What those imports import and a run never uses: Keras 3 imports matplotlib's pyplot and
# patches for keras.visualization alone, when matplotlib is installed (the bench's plots
# install it): 0.5 s of CPU of each process's 3.5 s start here. Inside them, matplotlib is
# not found (Keras' two modules catch the ImportError); once they are imported, each of
# DEFERRED (module, its attribute, what it imports) gets the module on its first use instead.
# (Deferring pyplot alone, with importlib.util.LazyLoader, still imported matplotlib itself:
# 0.23 s of it.)
DEFERRED = (
    ("keras.src.visualization.plot_image_gallery", "plt", "matplotlib.pyplot"),
    ("keras.src.visualization.plot_bounding_box_gallery", "patches", "matplotlib.patches"),
)


def _now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _stat(pid) -> tuple:
    """(parent pid, start in seconds since boot) of process ``pid`` from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[1]), int(fields[19]) / os.sysconf("SC_CLK_TCK")


def is_launcher(argv) -> bool:
    """Is ``argv`` a launcher's: its program, a Python script's name, or the first word of
    ``sh -c`` (horovodrun execs ``/bin/sh -c "mpirun ..."``) in LAUNCHERS?"""
    words = [os.path.basename(a) for a in argv[:2]]
    if len(argv) > 2 and words[0] in ("sh", "bash", "dash") and argv[1] == "-c":
        words += [os.path.basename((argv[2].split() or [""])[0])]
    return any(w in LAUNCHERS for w in words)


def _launcher(pid) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return is_launcher([a.decode(errors="replace") for a in f.read().split(b"\0") if a])


def launch_start() -> tuple | None:
    """(this process's start, the launch's start, "launcher" or "process": which one the
    launch's is), in CLOCK_BOOTTIME seconds; None where /proc cannot say."""
    try:
        parent, mine = _stat("self")
        start, since = mine, "process"
        for _ in range(GENERATIONS):
            if parent <= 1:
                break
            grandparent, began = _stat(parent)
            if _launcher(parent):
                start, since = began, "launcher"
            parent = grandparent
        return mine, start, since
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Clock:
    """Seconds per phase of this process; ``enter``/``leave`` (or ``phase``) mark them."""

    def __init__(self):
        self.began = self.last = _now()  # hvdtrain's first code
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.open: list = []  # names of the phases open, innermost last
        self.main = threading.get_ident()  # phases are the main thread's

    def _charge(self) -> None:
        now = _now()
        self.seconds[self.open[-1] if self.open else OUTSIDE] += now - self.last
        self.last = now

    def enter(self, name: str) -> int:
        """Open phase ``name`` inside the open ones; returns the depth to ``leave``."""
        if threading.get_ident() != self.main:
            return 0
        self._charge()
        self.open.append(name)
        return len(self.open)

    def leave(self, depth: int) -> None:
        """Close the phase opened at ``depth``, and any left open inside it."""
        if depth and threading.get_ident() == self.main:
            self._charge()
            del self.open[depth - 1 :]

    @contextlib.contextmanager
    def phase(self, name: str):
        depth = self.enter(name)
        try:
            yield
        finally:
            self.leave(depth)

    def report(self) -> dict:
        """Seconds per phase (all of PHASES), ``wall`` (the launch to now), the share of it
        ``training`` took (the first call not counted) and ``since``: where wall starts
        ("launcher", "process", or "hvdtrain" where /proc cannot say)."""
        self._charge()
        seconds = dict(self.seconds)
        found = launch_start()
        mine, start, since = (
            found
            if found and found[1] <= found[0] <= self.began
            else (self.began, self.began, "hvdtrain")
        )  # no /proc (or clocks that disagree)
        seconds["launcher"], seconds["startup"] = mine - start, self.began - mine
        wall = self.last - start
        out = {k: round(v, 3) for k, v in seconds.items()}
        out.update(
            wall=round(wall, 3),
            since=since,
            training_share=round(seconds["training"] / wall, 4) if wall > 0 else 0.0,
        )
        return out


def line(report: dict) -> str:
    """The one line ``--verbose 2`` prints: wall, training's share, every phase."""
    parts = ", ".join(f"{k} {report[k]:.2f}" for k in PHASES)
    return (
        f"hvdtrain: timings (rank 0, s): wall {report['wall']:.2f}, training "
        f"{report['training_share']:.0%} of it; {parts}"
    )


class _OnFirstUse:
    """A module imported when one of its attributes is first read."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)


def _hand_deferred_modules() -> None:
    """Each of DEFERRED that its import left without matplotlib gets it on first use."""
    waiting = [
        (module, attr, name)
        for module, attr, name in ((sys.modules.get(m), a, n) for m, a, n in DEFERRED)
        if module is not None and getattr(module, attr, ...) is None
    ]
    # Looked for only when one waits (this runs after each import of IMPORTED); not
    # installed: Keras says so itself, as without hvdtrain.
    if waiting and importlib.util.find_spec("matplotlib") is not None:
        for module, attr, name in waiting:
            setattr(module, attr, _OnFirstUse(name))


class _TimedLoader(WrappedLoader):
    inside = 0  # how many of IMPORTED are executing now (matplotlib is not found inside them)
    collecting = True  # was Python's garbage collector on before the outermost of them?

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.real  # as if never wrapped
        if _TimedLoader.inside == 0:
            # No garbage collection while they import: TensorFlow's import makes 330,000
            # objects that live as long as the process, and the collector's passes over them
            # were 0.5-0.9 s of the 2.8-3.2 s of CPU that importing Keras 3 and Horovod's
            # module took. Frozen after (gc.freeze: every object the process holds then, most
            # of them theirs; the collector never passes over them again), else the passes
            # come back later, inside the run (docs/performance/startup.md). What freezing
            # keeps that a collection would have freed: 4,000 objects after TensorFlow's import.
            _TimedLoader.collecting = gc.isenabled()
            gc.disable()
        _TimedLoader.inside += 1
        try:
            with phase("imports"):
                self.real.exec_module(module)
        finally:
            _TimedLoader.inside -= 1
            if _TimedLoader.inside == 0:
                if _TimedLoader.collecting:
                    gc.freeze()
                    gc.enable()
                _hand_deferred_modules()


class _Finder(WrappingFinder):
    """Wraps the loader of each of IMPORTED that the other finders find, to time its
    execution (once: an imported module is not looked for again); finds no matplotlib while
    they execute (unless it was imported before), for DEFERRED to import on first use."""

    loader = _TimedLoader

    def wants(self, name):
        return name in IMPORTED and name not in sys.modules

    def find_spec(self, name, path=None, target=None):
        if (
            _TimedLoader.inside > 0
            and name.split(".")[0] == "matplotlib"
            and "matplotlib" not in sys.modules
        ):
            raise ModuleNotFoundError(
                f"No module named {name!r} (yet: hvdtrain.base.timings)", name=name
            )
        return super().find_spec(name, path, target)


CLOCK = Clock()
phase, enter, leave, report = CLOCK.phase, CLOCK.enter, CLOCK.leave, CLOCK.report


def install() -> None:
    """Time the first imports of IMPORTED, defer matplotlib inside them (once per process)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def timed(name: str):
    """A decorator: each call of the function counts as phase ``name``."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)

        return call

    return wrap
