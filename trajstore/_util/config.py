"""Settings spelled once: a dataclass field with its help is a command-line flag.

A settings class (``ServeConfig``, ``ProxyConfig``, ``WorkerConfig``) declares each
option as one field made by :func:`option`: its default, its type (the annotation)
and the help its flag shows. :func:`add_flags` derives the argparse flags from the
fields, :func:`config_from_args` builds the settings back from what was parsed, so
a new option is one field and the command, the keyword API and the docs' table
cannot drift apart::

    @dataclass(frozen=True)
    class Settings:
        poll_s: float = option(1.0, help="seconds between looks (default 1)", min=0, min_exclusive=True)
        engine: Literal["vllm", "sglang"] = option("vllm", help="the engine (default vllm)")

    add_flags(parser, Settings)             # --poll-s, --engine {vllm,sglang}
    settings = config_from_args(Settings, parser.parse_args())

What the annotation says:

- ``bool``: a switch. Default False: ``--name`` sets it; default True: ``--no-name``
  clears it (the flag's own name may be given, e.g. ``--no-route-skip``).
- ``int`` / ``float``: parsed by ``trajstore._util.argtypes.number`` (finite, in
  ``min``/``max``), so ``nan`` and ``inf`` are refused in one line.
- ``Literal[...]``: the flag's ``choices``.
- ``tuple[str, ...]``: a flag given once per value (``action="append"``).
- ``X | None``: as ``X``; the flag's default is None.
- anything else: the flag's text, turned into the field's value by ``parse``
  when the settings are built (its ValueError is the command's one-line error).

``scale``: the flag speaks another unit than the field (``--linger-ms`` for
``linger_s``: ``scale=1e3``, the field is the flag's value / ``scale``).
``env``: the variable read when the flag is not given. ``bare``: the value of
the flag given without one (``--mlflow`` alone: MLflow's default URI). ``deprecated``: old
spellings that still work, with a ``DeprecationWarning`` naming the new one.
``flag=None``: a field with no flag of its own (set by the program, or by a
global flag named in ``dest``, e.g. the CLI's ``--store``); a name without
dashes (``flag="dir"``): a positional argument (optional when the field has a default).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
import warnings
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Literal, Mapping, Sequence, TypeVar, Union

__all__ = ["FieldFlag", "Flag", "add_flags", "config_from_args", "flags_of", "option"]

C = TypeVar("C")
_META = "trajstore.flag"


@dataclass(frozen=True)
class Flag:
    """How one field is spelled on the command line (the metadata :func:`option` stores)."""

    help: str
    name: str | None = ""  # "" derives --field-name; None: no flag of its own
    dest: str | None = None
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    scale: float | None = None
    env: str | None = None
    parse: Callable[[Any], Any] | None = None
    required: bool = False
    deprecated: tuple[str, ...] = ()
    group: str | None = None
    bare: Any = dataclasses.field(default_factory=lambda: MISSING)  # MISSING: the flag needs its value


def option(default: Any = MISSING, *, help: str, flag: str | None = "", dest: str | None = None,
           metavar: str | None = None, type: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | None = None, min: float | None = None, max: float | None = None,
           min_exclusive: bool = False, scale: float | None = None, env: str | None = None,
           parse: Callable[[Any], Any] | None = None, deprecated: Sequence[str] = (), group: str | None = None,
           bare: Any = MISSING, **field_kwargs: Any) -> Any:
    """A dataclass field that is also a flag (see the module's docstring for each keyword).

    ``default`` MISSING makes the flag required. ``flag``: the flag's name ("" derives
    ``--field-name``, or ``--no-field-name`` for a switch that defaults to True; None: no
    flag). ``dest``: the parsed attribute (default: from the flag's name)."""
    spec = Flag(help=help, name=flag, dest=dest, metavar=metavar, type=type, choices=choices, min=min, max=max,
                min_exclusive=min_exclusive, scale=scale, env=env, parse=parse, required=default is MISSING,
                deprecated=tuple(deprecated), group=group, bare=bare)
    metadata = {**field_kwargs.pop("metadata", {}), _META: spec}
    return dataclasses.field(default=default, metadata=metadata, **field_kwargs)


@dataclass(frozen=True)
class FieldFlag:
    """A field of a settings class with its flag: the name argparse knows it by and the parsed attribute."""

    field: dataclasses.Field
    spec: Flag
    kind: Any  # the annotation, Optional removed
    name: str | None
    dest: str


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def flags_of(cls: type) -> list[FieldFlag]:
    """The fields of ``cls`` made by :func:`option`, with their flag's name and parsed attribute."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_META)
        if spec is None:
            continue
        kind = _strip_optional(hints[f.name])
        name = spec.name
        if name == "":
            negated = kind is bool and f.default is True
            name = "--" + ("no-" if negated else "") + f.name.replace("_", "-")
        dest = spec.dest or (name.lstrip("-").replace("-", "_") if name else f.name)
        out.append(FieldFlag(f, spec, kind, name, dest))
    return out


def _is_switch(r: FieldFlag) -> bool:
    return r.kind is bool and r.spec.parse is None


def _is_repeated(r: FieldFlag) -> bool:
    """A ``tuple[str, ...]`` field: a flag given once per value (``action="append"``)."""
    return typing.get_origin(r.kind) is tuple and typing.get_args(r.kind)[1:] == (Ellipsis,)


def _negated(r: FieldFlag) -> bool:
    return _is_switch(r) and r.field.default is True


def _flag_default(r: FieldFlag) -> Any:
    default = r.field.default
    if default is MISSING or default is None or r.spec.scale is None:
        return default
    return default * r.spec.scale


class _DeprecatedSpelling(argparse.Action):
    """An old spelling of a flag: stores as the flag does, with a DeprecationWarning naming the new one."""

    def __init__(self, option_strings: list[str], dest: str, *, current: str, const: Any = None,
                 store: Any = None, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, const=const, **kwargs)
        self.current, self.store = current, store

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        warnings.warn(f"{option_string} is deprecated; use {self.current}", DeprecationWarning, stacklevel=2)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_flags(parser: Any, cls: type, *, only: Sequence[str] | None = None, skip: Sequence[str] = (),
              help_prefix: str = "", groups: Mapping[str, Any] | None = None) -> None:
    """Add the flags of ``cls``'s fields to ``parser`` (an ArgumentParser or group), in field order.

    ``only`` / ``skip``: the field names taken / left out (a command that has some of the flags
    already, or needs only some). ``help_prefix`` goes before each help text (``"with --follow: "``).
    A field's ``group`` (a title) puts its flag in that argument group of ``parser``, made once (or
    taken from ``groups``)."""
    made: dict[str, Any] = dict(groups or {})
    for r in flags_of(cls):
        if r.name is None or r.field.name in skip or (only is not None and r.field.name not in only):
            continue
        target = parser
        if r.spec.group is not None:
            if r.spec.group not in made:
                made[r.spec.group] = parser.add_argument_group(r.spec.group)
            target = made[r.spec.group]
        kwargs: dict[str, Any] = {"dest": r.dest, "help": help_prefix + r.spec.help}
        if _is_switch(r):
            kwargs.update(action="store_true")
        elif _is_repeated(r):
            kwargs.update(action="append", default=None)
            if r.spec.metavar is not None:
                kwargs.update(metavar=r.spec.metavar)
        else:
            kwargs.update(default=_flag_default(r), type=_argtype(r))
            if r.spec.required:
                kwargs.update(required=True)
                del kwargs["default"]
            if not r.name.startswith("-"):  # a positional argument: argparse names it; with a default, optional
                del kwargs["dest"]
                if kwargs.pop("required", None) is None:
                    kwargs.update(nargs="?")
            choices = r.spec.choices
            if choices is None and typing.get_origin(r.kind) is Literal:
                choices = typing.get_args(r.kind)
            if choices is not None:
                kwargs.update(choices=choices)
            if r.spec.metavar is not None:
                kwargs.update(metavar=r.spec.metavar)
            if r.spec.bare is not MISSING:
                kwargs.update(nargs="?", const=r.spec.bare)
        if kwargs.get("type") is None:
            kwargs.pop("type", None)
        target.add_argument(r.name, **kwargs)
        for old in r.spec.deprecated:
            alias = {"nargs": 0, "const": True} if _is_switch(r) else {"type": kwargs.get("type")}
            if "metavar" in kwargs:
                alias["metavar"] = kwargs["metavar"]
            target.add_argument(old, dest=r.dest, action=_DeprecatedSpelling, current=r.name,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS, **alias)


def _argtype(r: FieldFlag) -> Callable[[str], Any] | None:
    if r.spec.type is not None or r.spec.parse is not None:
        return r.spec.type
    kind = r.kind
    if kind in (int, float):
        from trajstore._util.argtypes import number

        # a scaled flag speaks another unit: MiB of an int of bytes is a float
        return number(float if r.spec.scale is not None else kind, min=r.spec.min, max=r.spec.max,
                      min_exclusive=r.spec.min_exclusive)
    return None


def config_from_args(cls: type[C], args: Any, **overrides: Any) -> C:
    """The ``cls`` the flags of :func:`add_flags` parsed into ``args`` stand for.

    A flag missing from ``args`` (a parser that did not add it) leaves the field's default;
    ``env`` is read when the flag was not given; ``overrides`` are fields the caller worked out."""
    values: dict[str, Any] = {}
    for r in flags_of(cls):
        name = r.field.name
        if name in overrides:
            continue
        value = getattr(args, r.dest, MISSING)
        if value is MISSING or value is argparse.SUPPRESS:
            continue
        if _negated(r):
            value = not value
        if value is None and r.spec.env is not None:
            value = os.environ.get(r.spec.env) or None
            if value is not None and _is_repeated(r):
                value = [value]
        if value is not None and _is_repeated(r):
            value = tuple(value)
        if value is not None:
            if r.spec.scale is not None:
                value = value / r.spec.scale
                if r.kind is int:
                    value = int(value)
            if r.spec.parse is not None:
                value = r.spec.parse(value)
        values[name] = value
    return cls(**values, **overrides)
