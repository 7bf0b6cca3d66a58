"""``python -m hvdtrain.mnist``: the built-in MNIST task's command line.

    horovodrun -np 2 python -m hvdtrain.mnist                     # two workers
    horovodrun -np 2 python -m hvdtrain.mnist --dataset fashion_mnist
    python -m hvdtrain.mnist --data-dir /data/mnist               # one process

The task itself (``MnistTask``, ``MnistSettings``) is ``hvdtrain.tasks.mnist``; its names
are handed on here, so ``hvdtrain.mnist:MnistTask`` names it too.
"""

from hvdtrain.cli import exit_now, run
from hvdtrain.tasks.mnist import MODELS, MnistSettings, MnistTask


def main(argv=None) -> int:
    """Train the MNIST task with the command line's flags.

    Args:
        argv: the flags (default: the program's).

    Returns:
        The exit status.
    """
    return run(MnistTask(), argv)


__all__ = ["MODELS", "MnistSettings", "MnistTask", "main"]

if __name__ == "__main__":
    exit_now(main())  # without the interpreter's teardown (hvdtrain.cli.exit_now)
