"""A real standalone Spark cluster on one machine, for tests/clusters/test_spark_cluster.py.

PySpark as the "spark" extra pins it (its own ``bin/spark-class``, Java 17), on three hosts
made by netns.Hosts: sparkhead (10.77.0.1), sparknode1 (10.77.0.2) and sparknode2
(10.77.0.3), network namespaces joined by a bridge, each with its own host name and
/etc/hosts.

- sparkhead runs the standalone Master (``spark-class org.apache.spark.deploy.master.Master
  --host 10.77.0.1 --port 7077``); each node runs a Worker registered with it (``spark-class
  org.apache.spark.deploy.worker.Worker spark://10.77.0.1:7077 --host ITS-ADDRESS --cores 1
  --memory 1g``). Both run in the foreground, children of the test process, with 256 MB heaps
  (SPARK_DAEMON_MEMORY; DAEMON_HEAP and JAVA_OPTS say what else keeps them small). Their web
  UIs stay on (the master's /json/ on 10.77.0.1:8080 is what ``workers`` reads; each
  namespace has its own ports, so nothing collides); the drivers have none.
- Everything the cluster writes is under one temporary directory (``temp``): SPARK_CONF_DIR
  (conf/, its spark-defaults.conf the drivers' settings), SPARK_LOG_DIR, each host's
  SPARK_LOCAL_DIRS and SPARK_WORKER_DIR (the executors' working directories and output:
  work/HOST/APP-ID/EXECUTOR-ID/stderr) and tmp/ (TMPDIR and Java's java.io.tmpdir). The
  daemons' output is in base/NAME-N.out.
- The cluster's environment (``env``) is the test's clean one with PYSPARK_PYTHON (this
  venv's python, for the executors' Python workers) and PYTHONPATH ``pythonpath`` (default:
  the checkout and tests/), which the executors' Python workers get too.

A driver runs on the head (``driver_cmd``). spark-defaults.conf sets what a driver needs:
the master, spark.driver.host 10.77.0.1 (the executors connect back to it), executors of
1 core and 512 MB, spark.task.cpus 1, no UI. A test's driver script is then just::

    from pyspark.sql import SparkSession
    spark = SparkSession.builder.master("spark://10.77.0.1:7077").getOrCreate()

(``cluster.master`` is that URL; ``.master(...)`` may be left out, the defaults set it),
run as ``run(cluster.driver_cmd([sys.executable, "driver.py"]), cluster.env)``. A script
that calls ``horovod.spark.run`` needs an ``if __name__ == "__main__":`` guard.

- ``kill_executor(host)``: the host's executor lost: SIGKILL to every process of the host but
  its Worker (the executor's JVM, CoarseGrainedExecutorBackend, its Python workers and what
  they started). The Worker reports the executor lost and the Master gives the application
  a new one there.
- ``remove_node(host)`` kills the whole host (its Worker too: a machine lost); ``add_node``
  starts its Worker again.
- ``workers()`` / ``wait_workers(n, timeout)``: the workers the Master lists ALIVE.

Measured on 2 cores shared with other test runs (load 14): both workers are ALIVE 9 to 15 s
after ``create`` starts (up to 30 s at the busiest), ``destroy`` takes under 1 s; at rest the
three daemons hold about 0.48 GB resident (about 160 MB each). A running application adds
its two executors (a JVM and Python workers each) and its driver on the head.

``destroy`` sends the daemons SIGTERM, kills what is left, deletes the namespaces and the
temporary directory, and checks that no process, namespace, mount or directory of the
cluster is left.
"""

import importlib.util
import json
import os
import shutil
import sys

import pytest

from conftest import ROOT, TESTS, TIME_SCALE, clean_env
from netns import Cluster, sh

NODES = {"sparkhead": "10.77.0.1", "sparknode1": "10.77.0.2", "sparknode2": "10.77.0.3"}
HEAD = "sparkhead"
IFACE = "hvds0"  # each host's end of its veth to the bridge (the Ray cluster's is hvdr0)
PORT = 7077  # the Master's, on the head's address
WEBUI = 8080  # the Master's web UI (its /json/), on the head's address
MASTER = f"spark://{NODES[HEAD]}:{PORT}"
# Every JVM of the cluster (daemons, executors, drivers): no /tmp/hsperfdata_USER/PID (a JVM
# killed with SIGKILL leaves its file there), one GC thread and no C2 compiler (fewer threads
# on a busy machine, about 10% less memory). ``create`` adds -Djava.io.tmpdir=TEMP/tmp.
JAVA_OPTS = "-XX:-UsePerfData -XX:+UseSerialGC -XX:TieredStopAtLevel=1"
# The daemons' heaps: 256 MB at most, 32 MB to start with (otherwise a quarter of the 256 MB
# is touched before the first collection): about 160 MB resident each instead of 250.
DAEMON_MEMORY = {"SPARK_DAEMON_MEMORY": "256m"}
DAEMON_HEAP = "-Xms32m"

# What a driver on the head gets without asking (SPARK_CONF_DIR/spark-defaults.conf).
DEFAULTS = {
    "spark.master": MASTER,
    "spark.driver.host": NODES[HEAD],
    "spark.driver.bindAddress": NODES[HEAD],
    "spark.driver.memory": "512m",
    "spark.executor.memory": "512m",
    "spark.executor.cores": "1",
    "spark.task.cpus": "1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
}

# The workers the Master lists, [{host, state, cores, coresused}], printed as JSON until
# WANT of them are ALIVE (a negative WANT: any) or DEADLINE (seconds) passes; exit 1 then.
WORKERS = """
import json, sys, time, urllib.request
url, want, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            state = json.load(r)
    except OSError:
        state = {"workers": []}
    workers = [{k: w[k] for k in ("host", "state", "cores", "coresused")}
               for w in state["workers"]]
    alive = sum(w["state"] == "ALIVE" for w in workers)
    if want < 0 or alive == want or time.monotonic() > deadline:
        print(json.dumps(workers), flush=True)
        sys.exit(0 if want < 0 or alive == want else 1)
    time.sleep(0.2)
"""


def parent(pid):
    """The parent of process ``pid`` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


class SparkCluster(Cluster):
    def __init__(self, base, pythonpath=(ROOT, TESTS)):
        spec = importlib.util.find_spec("pyspark")  # its install is SPARK_HOME
        home = os.path.dirname(spec.origin) if spec else None
        super().__init__(
            base,
            NODES,
            HEAD,
            tag="hvds",
            iface=IFACE,
            stop_seconds=10,
            env=clean_env(
                base / "home",
                PYTHONPATH=os.pathsep.join(pythonpath),
                TF_CPP_MIN_LOG_LEVEL="3",
                PYSPARK_PYTHON=sys.executable,
                PYSPARK_DRIVER_PYTHON=sys.executable,
                SPARK_HOME=home,
                SPARK_NO_DAEMONIZE="1",
                **DAEMON_MEMORY,
            ),
        )
        self.master = MASTER
        self.home = home

    # --- making it ------------------------------------------------------------------------
    def create(self):
        if self.home is None:
            pytest.fail("PySpark missing: pip install -c constraints.txt -e .[spark]")
        if not shutil.which("java"):
            pytest.skip("no Java here (Spark needs it): apt-get install openjdk-17-jre-headless")
        super().create(prefix="sparkcl-")
        conf, tmp = (os.path.join(self.temp, d) for d in ("conf", "tmp"))
        for d in (conf, tmp, os.path.join(self.temp, "logs")):
            os.mkdir(d)
        # Java's temporary files too (SparkSubmit's spark-UUID directories, left behind by a
        # JVM killed with SIGKILL), not only Python's (TMPDIR).
        java_opts = f"{JAVA_OPTS} -Djava.io.tmpdir={tmp}"
        with open(os.path.join(conf, "spark-defaults.conf"), "w") as f:
            f.writelines(
                f"{k} {v}\n"
                for k, v in {
                    **DEFAULTS,
                    "spark.driver.extraJavaOptions": java_opts,
                    "spark.executor.extraJavaOptions": java_opts,
                }.items()
            )
        self.env.update(
            SPARK_CONF_DIR=conf,
            SPARK_LOG_DIR=os.path.join(self.temp, "logs"),
            TMPDIR=tmp,
            SPARK_DAEMON_JAVA_OPTS=f"{java_opts} {DAEMON_HEAP}",
        )
        for name in NODES:
            self.start_node(name)
            if name == HEAD:  # the workers register with it
                self.wait_log(name, "I have been elected leader", 60)
        self.wait_workers(2, 60)
        return self

    def start_node(self, name):
        local, work = (os.path.join(self.temp, d, name) for d in ("local", "work"))
        os.makedirs(local, exist_ok=True)
        os.makedirs(work, exist_ok=True)
        cls = os.path.join(self.home, "bin", "spark-class")
        if name == HEAD:
            cmd = [
                cls,
                "org.apache.spark.deploy.master.Master",
                "--host",
                NODES[name],
                "--port",
                str(PORT),
                "--webui-port",
                str(WEBUI),
            ]
        else:
            cmd = [
                cls,
                "org.apache.spark.deploy.worker.Worker",
                MASTER,
                "--host",
                NODES[name],
                "--cores",
                "1",
                "--memory",
                "1g",
                "--work-dir",
                work,
            ]
        return self.launch(
            name, cmd, SPARK_LOCAL_DIRS=local, SPARK_WORKER_DIR=work, SPARK_LOCAL_IP=NODES[name]
        )

    # --- using it -------------------------------------------------------------------------
    def driver_cmd(self, cmd):
        """``cmd`` on the head: a PySpark driver there connects to the Master with the
        defaults of SPARK_CONF_DIR/spark-defaults.conf."""
        return self.on_node(
            HEAD,
            cmd,
            SPARK_LOCAL_IP=NODES[HEAD],
            SPARK_LOCAL_DIRS=os.path.join(self.temp, "local", HEAD),
        )

    def workers(self, want=-1, timeout=0):
        """[{host, state, cores, coresused}] of the workers the Master lists; with ``want``,
        polled until that many are ALIVE or ``timeout`` passes (then None)."""
        p = sh(
            *self.driver_cmd(
                [
                    sys.executable,
                    "-c",
                    WORKERS,
                    f"http://{NODES[HEAD]}:{WEBUI}/json/",
                    str(want),
                    str(timeout),
                ]
            ),
            timeout=timeout + 60 * TIME_SCALE,
        )
        if p.returncode not in (0, 1) or not p.stdout.strip():
            pytest.fail(
                f"reading the workers from the Master: rc {p.returncode}\n{p.stderr[-3000:]}"
            )
        workers = json.loads(p.stdout.strip().splitlines()[-1])
        return workers if p.returncode == 0 else None

    def wait_workers(self, n, timeout):
        """Until the Master lists ``n`` workers ALIVE; fail with the logs."""
        timeout *= TIME_SCALE
        if self.workers(n, timeout) is None:
            pytest.fail(
                f"SparkCluster: not {n} workers alive within {timeout:.0f}s: "
                f"{self.workers()}\n{self.logs()}"
            )

    def master_log(self):
        """The Master's output so far (its "Registering worker", "Launching executor",
        "Removing executor" lines)."""
        return "".join(
            f.read_text(errors="replace") for f in sorted(self.base.glob(f"{HEAD}-*.out"))
        )

    def executor_pids(self, name):
        """The executor JVMs (CoarseGrainedExecutorBackend) running on host ``name``."""
        found = []
        for pid in self.pids(name):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"CoarseGrainedExecutorBackend" in f.read():
                        found.append(pid)
            except OSError:
                pass
        return found

    def kill_executor(self, name):
        """Host ``name``'s executor lost: SIGKILL to every process of the host but its Worker
        (the executor's JVM, its Python workers, what they started). The Worker launches
        the executor the Master gives in its place at once: a child of the Worker that was
        not there at the kill is spared. Returns the pids killed."""
        assert name != HEAD, "the head runs no executor"
        worker = self.nodes[name].pid  # ip netns exec ... exec java: the Worker's JVM
        first = set(self.pids(name)) - {worker}
        killed = self.kill(
            name, spare=lambda p: p == worker or (p not in first and parent(p) == worker)
        )
        assert self.nodes[name].poll() is None, f"{name}'s Worker died with its executor"
        return killed
