"""Callbacks that run on rank 0 only (``hk.on_chief(callback)``): loggers, trackers, anything
that reports the run once, not once per rank.

Every other callback runs on every rank (each sees the same global metrics, and a callback
that changes training, such as ``EarlyStopping``, decides the same everywhere). A callback
that only observes belongs on rank 0: ``hk.on_chief`` says so, and the trackers' own
callbacks (W&B's ``WandbMetricsLogger``, ``WandbModelCheckpoint``, ``WandbEvalCallback``,
``WandbCallback``; MLflow's ``MlflowCallback``) and Keras' ``RemoteMonitor`` are taken as
chief-only without it.

On rank 0 each of the callback's calls runs under a time bound (``timeout``): a call that
raises, or does not return in time (a tracker's server that hangs), stops every rank with one
line naming the callback, its method and the user's line (exit 1): the other ranks, waiting
in the next step's allreduce, are told by the watchdog.
"""

from __future__ import annotations

import signal
import threading

from hvdtrain.base.errors import CallbackError, Error, error_line, show_tracebacks, user_frame

# Class names of callbacks that report the run to a tracker: rank 0's alone, as hk.on_chief's.
TRACKER_CALLBACKS = (
    "WandbMetricsLogger",
    "WandbModelCheckpoint",
    "WandbEvalCallback",
    "WandbCallback",
    "MlflowCallback",
    "MLflowCallback",
    "RemoteMonitor",
)
TIMEOUT = 300.0  # seconds a chief-only callback's call may take, unless told otherwise


class OnChief:
    """``hk.on_chief(callback)``: what ``hk.fit`` runs on rank 0 only (see the module)."""

    def __init__(self, callback, timeout: float | None = TIMEOUT):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"hk.on_chief(timeout={timeout!r}): must be more than 0, or None")
        self.callback, self.timeout = callback, timeout


def on_chief(callback, timeout: float | None = TIMEOUT) -> OnChief:
    """Run a Keras callback on rank 0 only, for ``hk.fit``'s ``callbacks``.

    For callbacks that report the run (a logger, a tracker): on the other ranks it does not
    run at all. Its logs are the epoch's metrics over every rank. A call that raises, or
    does not return within ``timeout`` seconds, stops every rank with one line naming the
    callback (exit 1) instead of leaving the other ranks waiting. The trackers' own
    callbacks (W&B's ``WandbMetricsLogger``, MLflow's ``MlflowCallback`` ...) run on rank 0
    only without it.

    Args:
        callback: a Keras callback that only observes the run (not one that changes it,
            such as ``EarlyStopping``: every rank must decide that the same).
        timeout: seconds each of its calls may take; None: no bound.

    Returns:
        The wrapped callback, to put in ``hk.fit(..., callbacks=[...])``.

    Raises:
        ValueError: ``timeout`` is not more than 0.
    """
    return OnChief(callback, timeout)


def chief_only(cb) -> OnChief | None:
    """``cb`` as an OnChief if it is one or a tracker's callback, else None."""
    if isinstance(cb, OnChief):
        return cb
    if any(k.__name__ in TRACKER_CALLBACKS for k in type(cb).__mro__):
        return OnChief(cb)
    return None


def keras_proxy(keras, wrapped: OnChief):
    """A Keras callback (of the Keras in use) that forwards every event to the wrapped one,
    each call bounded and named."""
    inner, timeout = wrapped.callback, wrapped.timeout
    name = type(inner).__name__

    def forward(method):
        def call(self, *args, **kwargs):
            fn = getattr(inner, method, None)
            if fn is None:
                return None
            try:
                with _bound(timeout):
                    return fn(*args, **kwargs)
            except Exception as e:  # said in one line: rank 0's alone
                if isinstance(e, Error) or show_tracebacks():
                    raise
                raise CallbackError(
                    f"hk.on_chief callback {name}.{method} raised {error_line(e)}{user_frame(e)}"
                ) from None

        return call

    # The events the callback handles (a batch hook that it leaves to the base class would
    # make Keras 2 copy the logs to numpy after every step for nothing).
    methods = {
        m: forward(m)
        for m in dir(keras.callbacks.Callback)
        if m.startswith("on_") and _overrides(inner, m)
    }

    def set_model(self, model):
        keras.callbacks.Callback.set_model(self, model)
        inner.set_model(model)

    def set_params(self, params):
        keras.callbacks.Callback.set_params(self, params)
        inner.set_params(params)

    proxy = type(
        f"OnChief{name}",
        (keras.callbacks.Callback,),
        {**methods, "set_model": set_model, "set_params": set_params},
    )()
    proxy.inner = inner
    proxy._supports_tf_logs = getattr(inner, "_supports_tf_logs", False)
    return proxy


def _overrides(callback, method: str) -> bool:
    """Does ``callback``'s class define ``method`` itself (not only a Keras ``Callback``)?"""
    for klass in type(callback).__mro__:
        if method in vars(klass):
            return klass.__name__ != "Callback"
    return False


class _bound:
    """The block within ``seconds`` (SIGALRM, on the main thread), else TimeoutError."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __enter__(self):
        self.armed = (
            self.seconds is not None and threading.current_thread() is threading.main_thread()
        )
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._expired)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def _expired(self, signum, frame):
        raise TimeoutError(f"did not return within {self.seconds:g} s (hk.on_chief's timeout)")

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False
