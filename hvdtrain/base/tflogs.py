"""TensorFlow's start-up lines on a machine without a GPU, kept off the console.

TensorFlow 2.21 logs through absl, and until something calls ``absl::InitializeLog()``
(TensorFlow never does) absl writes every message to stderr whatever its level:
``TF_CPP_MIN_LOG_LEVEL`` (hvdtrain sets 2) hides none of them. They are printed by the
static initialisers of two shared libraries that each carry their own absl
(``libtensorflow_framework.so.2`` and ``_pywrap_profiler_plugin.so``: so each line twice)
while ``import tensorflow`` loads them, before any Python code could change a setting; absl
reads no environment variable. On a machine without a GPU they say nothing to act on:

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I... port.cc:153] oneDNN custom operations are on. ...
    I... cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
    E... cuda_platform.cc:52] failed call to cuInit: ... (303)   (the first device listing)
    I... cpu_feature_guard.cc:227] This TensorFlow binary is optimized ... (and its next line)

So, once ``hvdtrain`` is imported, the first ``import tensorflow`` (wherever it happens)
runs with file descriptor 2 pointed at a temporary file, followed by the device listing
that makes the cuInit attempt; then every captured line except those is written back to
stderr, in order. The cuInit line is held back only after the "Could not find cuda
drivers" line (no driver at all): on a machine with a driver, a failing cuInit is shown.
``HVDTRAIN_TF_LOGS=1``, or ``TF_CPP_MIN_LOG_LEVEL`` 0 or 1, leaves stderr alone.
What a process writes to stderr in that window is delayed, not lost, unless the process
dies in it (a crash while TensorFlow loads: run with HVDTRAIN_TF_LOGS=1 to see it).
"""

import os
import re
import sys
import tempfile

from hvdtrain.base.importhooks import WrappedLoader, WrappingFinder

# absl's prefix: severity, date, time, thread, file:line]
_ABSL = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ (?P<file>[\w.]+):\d+\] (?P<msg>.*)$")
_HELD = {  # file -> start of the message held back
    "port.cc": "oneDNN custom operations are on.",
    "cudart_stub.cc": "Could not find cuda drivers on your machine",
    "cpu_feature_guard.cc": "This TensorFlow binary is optimized to use available CPU",
}
_NO_DRIVER_ONLY = ("cuda_platform.cc", "failed call to cuInit")
_ABSL_NOTE = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
)
_CPU_GUARD_TAIL = re.compile(
    r"^To enable the following instructions: .*, in other operations, "
    r"rebuild TensorFlow with the appropriate compiler flags\.$"
)


def wanted(environ=os.environ) -> bool:
    """Whether TensorFlow's start-up lines are held back in this process."""
    if environ.get("HVDTRAIN_TF_LOGS", "0").strip() not in ("", "0"):
        return False
    try:
        return int(environ.get("TF_CPP_MIN_LOG_LEVEL", "0")) >= 2
    except ValueError:
        return False


def kept_lines(text: str) -> str:
    """``text`` (captured stderr) without TensorFlow's start-up lines listed above."""
    out, no_driver = [], False
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\r\n")
        m = _ABSL.match(bare)
        if m:
            held = _HELD.get(m["file"])
            if held and m["msg"].startswith(held):
                no_driver = no_driver or m["file"] == "cudart_stub.cc"
                continue
            if no_driver and (m["file"], m["msg"][: len(_NO_DRIVER_ONLY[1])]) == _NO_DRIVER_ONLY:
                continue
        elif bare == _ABSL_NOTE or _CPU_GUARD_TAIL.match(bare):
            continue
        out.append(line)
    return "".join(out)


class _Held:
    """File descriptor 2 into a temporary file; on exit, the kept lines back to stderr."""

    def __enter__(self):
        try:
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):
            pass
        self.saved = None
        try:
            self.file = tempfile.TemporaryFile()
        except OSError:  # nowhere to hold the lines: show them
            return self
        try:
            self.saved = os.dup(2)
        except OSError:  # no stderr at all: nothing to keep quiet
            self.file.close()
            return self
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        if self.saved is None:
            return False
        try:
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):
            pass
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        text = self.file.read().decode("utf-8", "surrogateescape")
        self.file.close()
        data = kept_lines(text).encode("utf-8", "surrogateescape")
        while data:
            data = data[os.write(2, data) :]
        return False


class _QuietLoader(WrappedLoader):
    def exec_module(self, module):
        uninstall()  # once: this is TensorFlow's import itself
        module.__loader__ = module.__spec__.loader = self.real  # as if never wrapped
        if not wanted():
            return self.real.exec_module(module)
        with _Held():
            self.real.exec_module(module)
            try:  # the first device listing is what tries cuInit
                module.config.list_physical_devices("GPU")
            except Exception:  # noqa: BLE001 (whatever fails here fails again, loudly, later)
                pass


class _Finder(WrappingFinder):
    """Wraps the loader of the "tensorflow" spec that the other finders find. Stays in place
    until TensorFlow is executed: a find_spec() alone (an "is it installed?") imports nothing."""

    loader = _QuietLoader

    def wants(self, name):
        return name == "tensorflow"


def install():
    """Hold back TensorFlow's start-up lines when it is first imported (if not yet)."""
    if "tensorflow" not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def uninstall():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
