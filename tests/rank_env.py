"""What each rank's environment held when its Python started, whatever launched it.

    env = rank_env.logging(env, tmp_path)   # PYTHONPATH gets a sitecustomize that logs
    ... launch ...
    rank_env.starts(tmp_path)       # {(host, pid): [GLIBC_TUNABLES at each start]}

Every Python a launch starts imports the sitecustomize (launch_cluster.sh forwards
PYTHONPATH with -x, srun and horovodrun the whole environment); a rank of hvdtrain (a launcher's
rank variable set, hvdtrain on its command line) appends one line per start to a file in the
test's directory, which every host of the test clusters shares. A rank that re-executed
itself (hvdtrain/base/malloc.py) logs two starts under one pid. (The host name tells apart
the emulated pods' ranks, which have PID namespaces of their own.)
"""

import json
import os

from hvdtrain.base import malloc

SITE = """import json, os
if any(name in os.environ for name in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMIX_RANK")):
    with open("/proc/self/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\\0")
    if any("hvdtrain" in a for a in argv):
        with open({log!r}, "a") as f:
            f.write(json.dumps({{"host": os.uname().nodename, "pid": os.getpid(), "argv": argv,
                                "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES")}}) + "\\n")
"""


def install(directory, seen_as=None):
    """The logging sitecustomize in ``directory``/rank-env, which the ranks see at
    ``seen_as`` (a pod's mount of it; default: the same path); that folder as they see it."""
    shim = os.path.join(str(directory), "rank-env")
    os.makedirs(shim, exist_ok=True)
    seen = os.path.join(str(seen_as or directory), "rank-env")
    with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
        f.write(SITE.format(log=os.path.join(seen, "starts.jsonl")))
    open(os.path.join(shim, "starts.jsonl"), "a").close()  # for a pod's fsGroup to share
    return seen


def logging(env, directory):
    """``env`` with the logging sitecustomize first on PYTHONPATH (in ``directory``)."""
    return dict(env, PYTHONPATH=install(directory) + os.pathsep + env.get("PYTHONPATH", ""))


def starts(directory):
    """{(host, pid): [GLIBC_TUNABLES of each start, in order]} of the ranks logged in
    ``directory``."""
    out = {}
    path = os.path.join(str(directory), "rank-env", "starts.jsonl")
    for line in open(path) if os.path.exists(path) else ():
        entry = json.loads(line)
        out.setdefault((entry["host"], entry["pid"]), []).append(entry["GLIBC_TUNABLES"])
    return out


def expected(value=""):
    """GLIBC_TUNABLES a rank should start with, from a launch environment holding ``value``,
    on this machine: hvdtrain's decision (base/malloc.py's tunables)."""
    decided = malloc.tunables({"GLIBC_TUNABLES": value} if value else {})
    return decided if decided is not None else (value or None)


def assert_launcher_set_it(directory, ranks):
    """``ranks`` ranks, each started once (the launcher gave the tunable: no re-exec) with
    hvdtrain's GLIBC_TUNABLES."""
    got = starts(directory)
    assert len(got) == ranks and all(v == [expected()] for v in got.values()), got
