"""``python -m hvdtrain TASK [flags]``: the same as ``python -m hvdtrain.TASK [flags]``.

``python -m hvdtrain workers TASK [flags]`` prints the worker count those flags configure
(the launch scripts start that many processes).
"""
import sys

from hvdtrain.config import TASKS, parse_args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m hvdtrain {{{','.join(TASKS)}}} [flags]  (--help after the task)")
        return 0 if argv else 2
    task, rest = argv[0], argv[1:]
    if task == "workers" and rest and rest[0] in TASKS:
        print(parse_args(rest[0], rest[1:]).num_workers)
        return 0
    if task == "linear":
        from hvdtrain.linear import main as task_main
    elif task == "mnist":
        from hvdtrain.mnist import main as task_main
    else:
        sys.stderr.write(f"hvdtrain: error: unknown task {task!r}; choose one of "
                         f"{', '.join(TASKS)}\n")
        return 2
    return task_main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
