"""A bare ``horovodrun -np 2 python ...`` that imports hvdtrain: each rank starts itself again
with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 before anything else (hvdtrain/base/malloc.py), and
its large mallocs then get transparent huge pages; a user's own hugetlb value, and
HVDTRAIN_HUGETLB=0, are left alone. (Each launch script's own tests show that the ranks it
starts have the tunable from it: test_quiet, test_scripts, test_multihost, test_slurm,
test_k8s.)"""

import json
import re
import sys

import pytest

import rank_env
from conftest import HOROVODRUN, clean_env, run
from hvdtrain.base import malloc

# The rank: hvdtrain imported as a script does it, then 64 MiB malloc'd and written, and the
# huge pages that memory got (smaps' AnonHugePages of its mapping).
RANK = """import ctypes, json, os, re
import hvdtrain
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
address = libc.malloc(size)
ctypes.memset(address, 1, size)
huge = 0
for mapping in re.split(r"\\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
    start, end = (int(a, 16) for a in mapping.split()[0].split("-"))
    if start <= address < end:
        huge = int(re.search(r"AnonHugePages:\\s+(\\d+) kB", mapping).group(1))
rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK"))
print(json.dumps({"rank": int(rank), "pid": os.getpid(),
                  "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES"), "huge_kb": huge}))
"""
AVAILABLE = malloc.unavailable(malloc.glibc_version(), malloc.thp_mode()) is None


def ranks(tmp_path, **extra):
    """horovodrun -np 2 of RANK in a user's environment plus ``extra``: ({rank: its report},
    {pid: GLIBC_TUNABLES of each start}), all on this host."""
    (tmp_path / "hvdtrain_rank.py").write_text(RANK)
    env = rank_env.logging(clean_env(tmp_path / "home", **extra), tmp_path)
    p = run(
        [HOROVODRUN, "-np", "2", sys.executable, str(tmp_path / "hvdtrain_rank.py")],
        env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    # (mpirun tags each write: the line's newline may come tagged on its own)
    reports = [json.loads(m) for m in re.findall(r'<stdout>:(\{"rank".*?\})', p.stdout)]
    assert len(reports) == 2, p.stdout + p.stderr[-3000:]
    return (
        {r["rank"]: r for r in reports},
        {pid: v for (_, pid), v in rank_env.starts(tmp_path).items()},
    )


@pytest.mark.quick
def test_each_rank_starts_again_with_huge_pages(tmp_path):
    reports, starts = ranks(tmp_path)
    assert sorted(reports) == [0, 1]
    if not AVAILABLE:  # old glibc, or THP never: each rank as it was started
        assert all(v == [None] for v in starts.values()) and len(starts) == 2
        return
    # each rank: started by horovodrun without it, then again (the same pid) with it
    assert starts == {r["pid"]: [None, "glibc.malloc.hugetlb=1"] for r in reports.values()}
    for r in reports.values():
        assert r["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
        assert r["huge_kb"] >= 32 << 10, r  # most of the 64 MiB on 2 MiB pages


def test_a_users_own_value_and_the_off_switch_are_kept(tmp_path):
    """GLIBC_TUNABLES=glibc.malloc.hugetlb=0 (the user's): no re-exec, the value kept, no huge
    pages; HVDTRAIN_HUGETLB=0: no re-exec, nothing set."""
    for extra, want in (
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "glibc.malloc.hugetlb=0"),
        ({"HVDTRAIN_HUGETLB": "0"}, None),
    ):
        d = tmp_path / next(iter(extra))
        d.mkdir()
        reports, starts = ranks(d, **extra)
        assert sorted(reports) == [0, 1]
        assert starts == {r["pid"]: [want] for r in reports.values()}, extra
        assert all(r["GLIBC_TUNABLES"] == want for r in reports.values()), (extra, reports)
        if malloc.thp_mode() == "madvise":  # THP only where asked for: glibc did not ask
            assert all(r["huge_kb"] == 0 for r in reports.values()), (extra, reports)
