"""The troubleshooting guide (docs/guides/troubleshooting.md): every message it quotes is
the code's. The doctor's problem and fix lines are matched against the string templates of
every problem() call in hvdtrain/doctor.py; hvdtrain's own lines are produced here (the
preflight's, a bad flag's) or matched against the source's format strings (the watchdog's);
Horovod's and TensorFlow's are found in their installed libraries, or produced by running
the launcher (a network interface that does not exist)."""

import ast
import os
import re
import sys

import pytest

from conftest import ROOT, FakeWorld, clean_env, run
from docs_pages import block, docs_text
from hvdtrain.bench import harness

PAGE = "guides/troubleshooting.md"
TEXT = docs_text(PAGE)
NO_SUCH_IFACE = "nosuchif0"


def source(*parts):
    with open(os.path.join(ROOT, "hvdtrain", *parts)) as f:
        return f.read()


def section(title):
    start = TEXT.index(f"## {title}\n")
    end = TEXT.find("\n## ", start + 1)
    return TEXT[start : end if end != -1 else None]


def table(text):
    """The rows of the first Markdown table in ``text``, as lists of cells."""
    lines = [l for l in text.splitlines() if l.startswith("| ")]
    return [[c.strip() for c in l.strip("|").split(" | ")] for l in lines[2:]]


def test_the_doctor_command_is_the_cluster_guides():
    """tests/unit/test_doctor.py runs the cluster guide's command as printed."""
    assert (
        block("guides/troubleshooting.md", "python -m hvdtrain.doctor").commands()
        == block("guides/clusters/index.md", "python -m hvdtrain.doctor").commands()[:1]
    )


def doctor_templates():
    """(problem templates, fix templates) of hvdtrain/doctor.py's problem() calls, as
    regular expressions: a {placeholder} matches anything, SETUP is its value."""
    from hvdtrain import doctor

    constants = {"SETUP": doctor.SETUP, "REBUILD": doctor.REBUILD, "WHEEL": doctor.WHEEL}

    def pattern(node):
        if isinstance(node, ast.Name) and node.id in constants:
            return re.escape(constants[node.id])
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return re.escape(node.value)
        if isinstance(node, ast.JoinedStr):
            return "".join(
                re.escape(v.value)
                if isinstance(v, ast.Constant)
                else (
                    re.escape(constants[v.value.id])
                    if isinstance(v.value, ast.Name) and v.value.id in constants
                    else ".+"
                )
                for v in node.values
            )
        return None  # a variable: said by its own section

    problems, fixes = [], []
    for node in ast.walk(ast.parse(source("doctor.py"))):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "problem"
            and len(node.args) == 2
        ):
            what, fix = map(pattern, node.args)
            if what is not None:
                problems.append(what)
                fixes.append(fix)
    return problems, fixes


def test_the_doctor_table_is_the_doctors_problems_and_fixes():
    problems, fixes = doctor_templates()
    assert len(problems) >= 10
    rows = table(section("First: the doctor, on every node"))
    assert len(rows) == len(problems), rows
    said = [re.findall(r"`([^`]+)`", row[0])[0] for row in rows]
    for template in problems:  # every problem the doctor can print has its row
        assert any(re.fullmatch(template, s) for s in said), template
    for row in rows:
        fix = row[2]
        if fix == "the same as above":
            continue
        (fix,) = re.fullmatch(r"`([^`]+)`", fix).groups()
        assert any(re.fullmatch(t, fix) for t in fixes), fix


def test_the_wheel_beside_another_tensorflow(tmp_path):
    """The line of horovodrun (and the doctor, and a launched job) when Horovod's wheel was
    built against TensorFlow 2.21.0 and 2.20.0 is installed: made by hvdtrain's own check,
    with a Horovod build record that names 2.21.0 and an installed TensorFlow 2.20.0 (each
    a file on the path ahead of the real ones)."""
    (line,) = block(
        "guides/troubleshooting.md", "horovodrun: error: horovod 0.28.1+hvdtrain.1"
    ).text.splitlines()
    fake = tmp_path / "site"
    (fake / "horovod").mkdir(parents=True)
    (fake / "horovod" / "__init__.py").write_text("")
    (fake / "horovod" / "hvdtrain_built.json").write_text('{"tensorflow": "2.21.0"}')
    for name, version in (("tensorflow", "2.20.0"), ("horovod", "0.28.1+hvdtrain.1")):
        info = fake / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    code = "from hvdtrain.distributed import tensorflow_mismatch; print(tensorflow_mismatch())"
    p = run(
        [sys.executable, "-c", code],
        clean_env(tmp_path / "home", PYTHONPATH=f"{fake}{os.pathsep}{ROOT}"),
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "horovodrun: error: " + p.stdout.strip() == line, p.stdout


def test_versions_that_differ_between_ranks():
    from hvdtrain.engine import preflight

    (line,) = block("guides/troubleshooting.md", "ranks disagree before step 0:").text.splitlines()
    with pytest.raises(preflight.PreflightError) as e:
        preflight.check(
            FakeWorld([{"version.tensorflow": "2.20.0"}]), {"version.tensorflow": "2.21.0"}
        )
    assert str(e.value) == line


def test_exit_statuses_and_a_bad_flags_line(tmp_path):
    from hvdtrain.base import errors

    rows = table(section("Exit statuses"))
    assert [int(r[0]) for r in rows] == [
        errors.EXIT_FAILED,
        errors.EXIT_USAGE,
        errors.EXIT_PEER_LOST,
        errors.EXIT_RUN_DIR_HELD,
        errors.EXIT_STORAGE,
        errors.EXIT_PREEMPTED,
    ]
    (example,) = re.findall(r"`(python -m hvdtrain\.linear: error: [^`]+)`", rows[1][1])
    p = run(
        [sys.executable, "-m", "hvdtrain.linear", "--learning-rate", "-1"],
        clean_env(tmp_path / "home"),
        timeout=60,
        cwd=str(tmp_path),
    )
    assert p.returncode == errors.EXIT_USAGE and p.stderr.strip() == example, p.stderr


def test_open_mpis_kill_delay_is_one_second_and_the_pages_export_sets_it(tmp_path):
    """The page's cause (Open MPI kills one second after its SIGTERM) is Open MPI's default,
    and its export is the setting's name as Open MPI reads it from the environment."""
    text = section("Ctrl-C left no checkpoint at the stop")
    assert "kills the processes one second after" in text
    (line,) = block("guides/troubleshooting.md", "export OMPI_MCA_odls").commands()
    name, value = line.removeprefix("export ").split("=")

    def current(env):
        out = run(["ompi_info", "--param", "odls", "base", "--level", "9"], env, timeout=60)
        assert out.returncode == 0, out.stderr
        (m,) = re.findall(r'"odls_base_sigkill_timeout" \(current value: "(\d+)"', out.stdout)
        return int(m)

    env = clean_env(tmp_path / "home")
    env.pop(name, None)
    assert current(env) == 1  # Open MPI's default: one second
    assert current({**env, name: value}) == int(value) == 30


def test_the_watchdogs_lines_are_its_format():
    (line,) = block("guides/troubleshooting.md", "hvdtrain: error: rank 1 (node7").text.splitlines()
    m = re.fullmatch(
        r"hvdtrain: error: (rank \d+ \(\w+, pid \d+\)) stopped answering: "
        r"no heartbeat for \d+ s \(frozen or stalled\) at step \d+",
        line,
    )
    assert m, line
    code = source("engine", "watchdog.py") + source("engine", "watchdog_link.py")
    assert 'f"rank {self.rank} ({self.host}, pid {self.pid})"' in code
    assert 'f"hvdtrain: error: {message}\\n"' in code
    assert re.search(
        r'f"\{peer\} stopped answering: no heartbeat for "\s+'
        r'f"\{now - peer\.last_seen:\.0f\} s \(frozen or stalled\) at step "',
        code,
    )
    assert 'f"{peer} died: its connection closed at step {self.step}"' in code
    assert "f\"rank 0's watchdog unreachable at" in code and 'f"hvdtrain: warning: ' in code
    assert "`... died: its connection closed at step ...`" in TEXT
    assert "`hvdtrain: warning: rank 0's watchdog unreachable ...`" in TEXT


def horovod_library():
    import horovod

    folder = os.path.join(os.path.dirname(horovod.__file__), "tensorflow")
    (name,) = [f for f in os.listdir(folder) if f.startswith("mpi_lib") and f.endswith(".so")]
    with open(os.path.join(folder, name), "rb") as f:
        return f.read()


def test_horovods_stall_warning_is_its_librarys():
    from hvdtrain.distributed import horovod_setup

    (line,) = block(
        "guides/troubleshooting.md", "One or more tensors were submitted"
    ).text.splitlines()
    head, tail = line.split(" 60 seconds")
    assert tail == "." and (head + " ").encode() in horovod_library()
    assert b"Missing ranks:" in horovod_library()
    assert (
        f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={horovod_setup.STALL_SHUTDOWN_SECONDS}`" in TEXT
        and horovod_setup.STALL_SHUTDOWN_SECONDS == "600"
    )


def test_the_interface_list_command_runs_as_printed(tmp_path):
    (line,) = block("guides/troubleshooting.md", "ip -brief address").commands()
    p = run(line.split(), clean_env(tmp_path / "home"), timeout=30)
    assert p.returncode == 0 and re.search(r"^lo\s", p.stdout, re.M), p.stdout + p.stderr
    assert NO_SUCH_IFACE not in p.stdout


def test_an_interface_horovodrun_does_not_find(tmp_path):
    """horovodrun stops before starting any rank; the page quotes its last line."""
    cmd = [
        harness.HOROVODRUN,
        "-np",
        "2",
        "--network-interface",
        NO_SUCH_IFACE,
        *harness.python("hvdtrain.linear", "--run-dir", tmp_path / "run"),
    ]
    p = run(cmd, clean_env(tmp_path / "home"), timeout=60)
    said = "ValueError: No interface is found for address 127.0.0.1."
    assert p.stderr.strip().splitlines()[-1] == said, p.stderr[-2000:]
    assert f"`{said}`" in TEXT and not os.path.exists(tmp_path / "run")


def test_open_mpi_warns_and_trains_on_an_interface_it_does_not_know(tmp_path):
    """The warning is Open MPI's help text (its help file, from ompi_info's pkgdatadir); a
    launch with a name no host has trains all the same (the name ignored)."""
    import subprocess

    warning = block(
        "guides/troubleshooting.md", "WARNING: An invalid value was given for btl_tcp_if_include."
    ).text
    out = subprocess.run(
        ["ompi_info", "--path", "pkgdatadir", "--parsable"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    (folder,) = re.findall(r"^path:pkgdatadir:(.+)$", out, re.M)
    with open(os.path.join(folder, "help-mpi-btl-tcp.txt")) as f:
        helps = f.read()
    topic = helps[helps.index("[invalid if_inexclude]\n") :]
    assert topic.split("\n", 1)[1].startswith(warning.replace("if_include", "if_%s")), topic
    cmd = harness.mpirun(
        2,
        [
            "--mca",
            "btl_tcp_if_include",
            NO_SUCH_IFACE,
            *harness.python("hvdtrain.linear", "--epochs", "1", "--run-dir", tmp_path / "run"),
        ],
    )
    p = run(cmd, clean_env(tmp_path / "home"), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert os.path.exists(tmp_path / "run" / "result.json")  # it trained: the name ignored


def test_out_of_memory_lines_are_tensorflows_and_hvdtrains():
    import tensorflow as tf

    folder = os.path.dirname(tf.__file__)
    (lib,) = [
        f
        for f in os.listdir(folder)
        if f.startswith("libtensorflow_framework.so")
        and not os.path.islink(os.path.join(folder, f))
    ][:1]
    with open(os.path.join(folder, lib), "rb") as f:
        assert b"OOM when allocating tensor" in f.read()
    assert 'f"{where} failed on rank {rank}: {first_line(e)}"' in source("base", "errors.py")
    assert 'f"training step {failed}"' in source("tasks", "epochs.py")
    assert "`training step N failed on rank R: `" in section("Out of memory")


def test_the_start_up_lines_are_the_references():
    reference = docs_text("reference/startup-lines.md")
    for quoted in (
        "oneDNN custom operations are on",
        "Could not find cuda drivers on your machine",
        "failed call to cuInit",
    ):
        assert f"`{quoted}`" in section("TensorFlow's start-up lines") and quoted in reference
    assert "HVDTRAIN_TF_LOGS" in source("base", "tflogs.py")
