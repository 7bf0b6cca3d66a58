"""``hvdtrain.base.waits.call_within``: the bounded call behind Horovod's shutdown at a rank's
exit and the Ray front's releases, at its three outcomes."""

import threading
import time

import pytest

from hvdtrain.base.waits import call_within


@pytest.mark.quick
def test_a_call_that_ends_in_time():
    seen = []
    assert call_within(lambda: seen.append(threading.current_thread().name), 5, "x") == (True, None)
    assert seen == ["x"]  # it ran in its own named thread


@pytest.mark.quick
def test_a_call_that_raises_hands_back_its_error():
    def fail():
        raise RuntimeError("MPI_Finalize failed")

    ended, error = call_within(fail, 5)
    assert ended and isinstance(error, RuntimeError) and str(error) == "MPI_Finalize failed"


@pytest.mark.quick
def test_a_call_that_blocks_is_left_after_the_bound():
    release = threading.Event()
    start = time.monotonic()
    ended, error = call_within(release.wait, 0.2, "blocked")
    waited = time.monotonic() - start
    assert (ended, error) == (False, None)
    assert 0.2 <= waited < 5  # the bound, not the call, ended the wait
    (left,) = [t for t in threading.enumerate() if t.name == "blocked"]
    assert left.daemon  # it cannot hold the process's exit
    release.set()
    left.join(5)
