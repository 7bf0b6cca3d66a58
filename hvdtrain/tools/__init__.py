"""Tools for hvdtrain's developers, not part of training: nothing else in hvdtrain imports
this package.

- ``harness``: the process harness of the tests and the benchmarks (run hvdtrain as a user
  would, each process in its own session, bounded in time);
- ``bench``: the benchmark suite (``python -m hvdtrain.bench``; its plots need the
  ``bench`` extra).

May import: anything of hvdtrain.
"""
