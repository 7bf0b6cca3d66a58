"""A module's loader wrapped at its first import: what ``tflogs`` (TensorFlow's start-up lines
held back) and ``timings`` (the first imports timed) both hook into the import system with.

- ``WrappingFinder``: a meta-path finder that finds nothing itself: for a module it
  ``wants``, it asks the other finders and hands their spec on with its loader wrapped in
  the finder's ``loader`` class;
- ``WrappedLoader``: that wrapper's base, creating the module as the real loader does;
  subclasses run their ``exec_module`` around the real one's.
"""

import importlib.abc
import importlib.util


class WrappedLoader(importlib.abc.Loader):
    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)


class WrappingFinder(importlib.abc.MetaPathFinder):
    loader = WrappedLoader  # the class each wanted module's loader is wrapped in
    busy = False

    def wants(self, name: str) -> bool:
        raise NotImplementedError

    def find_spec(self, name, path=None, target=None):
        if self.busy or not self.wants(name):
            return None
        self.busy = True  # importlib.util.find_spec asks this finder again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        if spec is not None and spec.loader is not None:
            spec.loader = self.loader(spec.loader)
        return spec
