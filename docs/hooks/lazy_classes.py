"""Griffe extension for the API reference: ``SyncBatchNormalization``, a class that hvdtrain
makes on first use (a subclass of the BatchNormalization of the Keras in use, see
hvdtrain/distributed/layers.py), shown as the class it is, with no import of Keras.

Griffe reads the source without running it, so a class made by a module's ``__getattr__`` is
not there to read: this extension adds it to ``hvdtrain.distributed.layers`` with that
module's docstring (which describes the layer), and hands it on from ``hvdtrain.layers`` and
``hvdtrain`` as their ``__getattr__`` does.
"""
import griffe

HOME = "hvdtrain.distributed.layers"
NAME = "SyncBatchNormalization"
HANDED_ON = ("hvdtrain", "hvdtrain.layers")


class LazyClasses(griffe.Extension):
    def on_module(self, *, mod, **kwargs):
        if mod.path == HOME and NAME not in mod.members:
            cls = griffe.Class(NAME, lineno=1, endlineno=1,
                               bases=["keras.layers.BatchNormalization"])
            cls.docstring = griffe.Docstring(mod.docstring.value, parent=cls)
            init = griffe.Function(
                "__init__", parent=cls, parameters=griffe.Parameters(
                    griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword),
                    griffe.Parameter("kwargs", kind=griffe.ParameterKind.var_keyword)))
            cls.set_member("__init__", init)
            mod.set_member(NAME, cls)
        elif mod.path in HANDED_ON and NAME not in mod.members:
            mod.set_member(NAME, griffe.Alias(NAME, f"{HOME}.{NAME}", parent=mod))
