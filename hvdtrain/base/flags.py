"""The command line of a task, derived from ``Config`` and the task's own ``Settings``.

Every field of both is a flag named after it (``learning_rate`` -> ``--learning-rate``), with
its type, choices, default and help taken from the field (``config.py`` says what each
means); ``--help`` shows each default. A bad flag or value is one line,
``prog: error: --flag=value: reason``, and exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Sequence

from hvdtrain.base.config import Config, validate_settings
from hvdtrain.base.errors import ConfigError, TaskError, user_code


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: --flag=value: reason``, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _optional(parse):
    def parse_optional(text: str):
        return None if text.lower() in ("none", "") else parse(text)

    parse_optional.__name__ = parse.__name__  # argparse names the type in its errors
    return parse_optional


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


_finite_float.__name__ = "float"


def _add_fields(group, cls, defaults: dict) -> None:
    """One flag per dataclass field; its type, choices and help come from the field."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        optional = type(None) in typing.get_args(hint)
        base = [a for a in typing.get_args(hint) if a is not type(None)][0] if optional else hint
        kwargs = dict(default=defaults[f.name], help=f.metadata.get("help", ""), dest=f.name)
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) in (tuple, list):
            item = typing.get_args(base)[0]
            kwargs.update(type=_finite_float if item is float else item, nargs="+")
        else:
            parse = _finite_float if base is float else base
            kwargs["type"] = _optional(parse) if optional else parse
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        group.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def build_parser(task, prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``task``: the training flags, then the task's own (if any).
    A task whose declarations break the rules (an unknown name in ``defaults``, a setting
    named like a training flag) is refused with a TaskError."""
    name, known = type(task).__name__, {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(task.defaults) - known)
    if unknown:
        raise TaskError(
            f"{name}.defaults names {', '.join(map(repr, unknown))}, not a "
            "training setting (hvdtrain.Config's fields)"
        )
    clash = sorted(
        known & {f.name for f in dataclasses.fields(task.Settings)}
        if task.Settings is not None
        else ()
    )
    if clash:
        raise TaskError(
            f"{name}.Settings field(s) {', '.join(map(repr, clash))} would shadow the "
            "training flag(s) of that name: rename them, or set the training "
            "value in defaults"
        )
    defaults = Config(**task.defaults)
    parser = _Parser(
        prog=prog or f"python -m hvdtrain.{task.name}",
        description=(task.description or f"Train the {task.name} task")
        + " with synchronous data-parallel SGD (Horovod).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_fields(parser.add_argument_group("training"), Config, dataclasses.asdict(defaults))
    if task.Settings is not None:
        current = getattr(task, "settings", None) or task.Settings()
        _add_fields(
            parser.add_argument_group(f"{task.name} task"),
            task.Settings,
            {f.name: getattr(current, f.name) for f in dataclasses.fields(task.Settings)},
        )
    return parser


def given_run_dir(argv: Sequence[str], prog: str) -> str | None:
    """The run directory a task's command line gives: its ``--run-dir``, the last one, taken
    as the whole command line takes it (``none`` or empty: none given), else None. Neither
    the task nor its other flags are loaded or checked. Exit 2 with one line on a
    ``--run-dir`` without its value."""
    parser = _Parser(prog=prog, add_help=False)
    parser.add_argument("--run-dir", type=_optional(str), default=None, dest="run_dir")
    return parser.parse_known_args(list(argv))[0].run_dir


def parse_args(task, argv: Sequence[str] | None = None, prog: str | None = None) -> Config:
    """Parse ``task``'s command line: return the Config, and set ``task.settings`` from its
    own flags. Exit 2 with one line on a bad flag or value."""
    parser = build_parser(task, prog)
    parsed = vars(parser.parse_args(argv))
    own = [f.name for f in dataclasses.fields(task.Settings)] if task.Settings else []
    try:
        config = Config(**{k: v for k, v in parsed.items() if k not in own}).validate()
        if task.Settings is not None:
            settings = task.Settings(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in parsed.items() if k in own}
            )
            with user_code(f"{type(task).__name__}.Settings.validate"):
                validate_settings(settings)
            task.settings = settings
    except (ConfigError, ValueError) as e:  # the user's validate(): a ValueError is a bad value
        parser.error(str(e))
    return config
