"""The command line of a cluster front (``python -m hvdtrain.ray``, ``python -m
hvdtrain.spark``) after its own flags are parsed: its extra's packages checked, the job run,
its error one line with the job's exit status."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from hvdtrain.base.errors import EXIT_USAGE, Error


def parser(prog: str, description: str, options) -> argparse.ArgumentParser:
    """A front's parser: ``options(p)`` adds the front's own flags, then TARGET and its flags."""
    example = f"{prog} mnist --help"
    p = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"The target's own flags follow it ({example} shows the task's).",
    )
    options(p)
    p.add_argument(
        "target", help="a task (mnist, linear, package.module:TaskClass) or a script path"
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="the target's flags")
    return p


def front_main(
    prog: str, needs: Sequence[str], what: str, extra: str, call: Callable[[], object]
) -> int:
    """``call()`` (the front's ``run``) once the packages ``needs`` import; the exit status."""
    try:
        for name in needs:
            importlib.import_module(name)
    except ImportError as e:
        sys.stderr.write(
            f"{prog}: error: {what} is not installed ({e}): pip install 'hvdtrain[{extra}]'\n"
        )
        return EXIT_USAGE
    try:
        call()
    except Error as e:
        if not getattr(e, "said", False):
            sys.stderr.write(f"{prog}: error: {e}\n")
        return e.status
    return 0
