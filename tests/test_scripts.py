"""The launch scripts, run for real, and the shell scripts' syntax and lint."""
import glob
import os
import shutil
import subprocess

import numpy as np
import pytest

from conftest import ROOT, result, run

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "*.sh"))) + [os.path.join(ROOT, ".ci", "run")]


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_bash_syntax_and_shellcheck(script):
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck missing: scripts/setup.sh installs it")
    p = subprocess.run(["shellcheck", script], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def test_launch_local_starts_the_configured_worker_count(env, tmp_path):
    p = run(["bash", os.path.join(ROOT, "scripts", "launch_local.sh"), "linear",
             "--run-dir", str(tmp_path), "--epochs", "3"], env)
    assert p.returncode == 0, p.stderr
    r = result(tmp_path)
    assert r["world_size"] == 2 and r["global_step"] == 3


def test_launch_cluster_with_a_hostfile(env, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    p = run(["bash", os.path.join(ROOT, "scripts", "launch_cluster.sh"), str(hostfile),
             "linear", "--run-dir", str(tmp_path / "r")], dict(env, IFACE="lo"))
    assert p.returncode == 0, p.stderr
    r = result(tmp_path / "r")
    assert r["world_size"] == 2
    np.testing.assert_allclose(r["weights"], [0.1, 0.2, 0.3], atol=1e-3)


def test_launch_cluster_rejects_a_missing_hostfile(env, tmp_path):
    p = run(["bash", os.path.join(ROOT, "scripts", "launch_cluster.sh"),
             str(tmp_path / "nohosts"), "linear"], env, timeout=30)
    assert p.returncode == 2 and "cannot read hostfile" in p.stderr
