"""A rank of a job on a cluster front, as its process starts: ``python -m hvdtrain.jobs.worker
RESULT [FLAGS]``.

Reads the job from stdin (pickled by the driver: a Task, or a function and its arguments),
runs it (a Task with FLAGS) as a launched rank runs (``hvdtrain.cli.run`` for a Task: the same
flags, lines and exit statuses as ``python -m hvdtrain``), writes what it returned to RESULT
(pickled), and exits with its status.
"""

import pickle
import sys
import traceback

from hvdtrain.base.errors import EXIT_FAILED, Error


def main(result_path: str, argv: list) -> int:
    from hvdtrain.cli import report, run

    job = pickle.loads(sys.stdin.buffer.read())
    prog = job["prog"]
    returned = []
    if job["kind"] == "task":
        task = job["task"]
        if isinstance(task, str):
            from hvdtrain.tasks.task import load_task

            try:
                task = load_task(task)
            except Error as e:
                return report(prog, e)
        status = run(task, argv, prog, on_result=returned.append)
    else:  # a function: what it returns is the result
        try:
            returned.append(job["function"](*job["args"], **job["kwargs"]))
            status = 0
        except Error as e:
            status = report(prog, e)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 (the user's: its traceback, as Python says it)
            traceback.print_exc()
            status = EXIT_FAILED
    if status == 0 and returned:
        with open(result_path, "wb") as f:
            pickle.dump(returned[0], f)
    return status


if __name__ == "__main__":
    from hvdtrain.cli import exit_now

    exit_now(main(sys.argv[1], sys.argv[2:]))
