"""``python -m hvdtrain.linear``: the built-in linear regression's command line.

    horovodrun -np 2 python -m hvdtrain.linear     # two workers, as the reference program
    python -m hvdtrain.linear                      # one process: the same weights

The task itself (``LinearTask``, ``LinearSettings``) is ``hvdtrain.tasks.linear``; its names
are handed on here, so ``hvdtrain.linear:LinearTask`` names it too.
"""

from hvdtrain.cli import exit_now, run
from hvdtrain.tasks.linear import LinearSettings, LinearTask


def main(argv=None) -> int:
    """Train the linear task with the command line's flags.

    Args:
        argv: the flags (default: the program's).

    Returns:
        The exit status.
    """
    return run(LinearTask(), argv)


__all__ = ["LinearSettings", "LinearTask", "main"]

if __name__ == "__main__":
    exit_now(main())  # without the interpreter's teardown (hvdtrain.cli.exit_now)
