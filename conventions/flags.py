"""A process's command line made from its config: one frozen dataclass is the spec of its flags.

A field declared with ``option(...)`` is the flag of the same name, dashed (``http_timeout`` is
``--http-timeout``); its default is the flag's default (``--help`` shows it, ``conventions/flag_help.py``),
its annotation gives the flag's type (``int``, ``float``, ``str``, ``Path``, each optional; ``bool`` is a
``--name``/``--no-name`` switch; ``tuple[T, ...]`` a repeated flag, named in the singular where the field is
in the plural: ``adapter_roots`` is ``--adapter-root A --adapter-root B``). Three functions serve every process:

- ``add_options(parser, Config)`` adds the flags;
- ``from_args(Config, args)`` builds the config from what argparse parsed (the config validates itself);
- ``to_argv(config)`` gives back the flags that build ``config`` (those whose value is not the default), so a
  launcher (``lorafleet up``) passes configs to the processes it starts instead of spelling their flags.

Fields declared without ``option`` have no flag (settings tests and launchers may still pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_KEY = "lorafleet.flag"


@dataclass(frozen=True)
class Flag:
    """What a config field's flag needs beyond its name, default and type."""

    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # a flag's text -> the field's value (or one item of a repeated flag)
    show: Callable[[Any], str] = str  # the inverse, for ``to_argv``
    group: str | None = None  # the --help section it is listed under


def option(help: str, default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
           choices: tuple[str, ...] | list[str] | None = None, metavar: str | None = None,
           parse: Callable[[str], Any] | None = None, show: Callable[[Any], str] = str,
           group: str | None = None) -> Any:
    """A config field that is also a flag of the same name (no default: a required flag)."""
    spec = Flag(help, tuple(choices) if choices is not None else None, metavar, parse, show, group)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: spec})


@dataclass(frozen=True)
class _Option:
    field: dataclasses.Field
    spec: Flag
    kind: type  # the value's type (an item's, for a repeated flag)
    repeated: bool

    @property
    def flag(self) -> str:
        name = self.field.name
        return flag_name(name[:-1] if self.repeated and name.endswith("s") else name)

    @property
    def required(self) -> bool:
        return self.field.default is dataclasses.MISSING and self.field.default_factory is dataclasses.MISSING

    @property
    def computed(self) -> bool:
        """Whether the default is made by a factory, when the config is built (from the environment, say)."""
        return self.field.default_factory is not dataclasses.MISSING and not self.repeated

    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return None if self.required else self.field.default


def flag_name(field_name: str) -> str:
    """``--the-flag`` of ``the_flag``."""
    return "--" + field_name.replace("_", "-")


def options(config: type) -> list[_Option]:
    """The flagged fields of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(config)
    found = []
    for f in dataclasses.fields(config):
        spec = f.metadata.get(_KEY)
        if spec is None:
            continue
        kind, repeated = _kind(hints[f.name], f.name, spec.parse is not None)
        found.append(_Option(f, spec, kind, repeated))
    return found


def _kind(annotation: Any, name: str, parsed: bool) -> tuple[Any, bool]:
    """(the type a flag's text becomes, whether the flag repeats) for a field's annotation; any type where the
    flag has its own ``parse``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        if len(args) != 1:
            raise TypeError(f"{name}: a flag's field is one type or that type | None, not {annotation}")
        return _kind(args[0], name, parsed)
    if typing.get_origin(annotation) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _kind(args[0], name, parsed)[0], True
    if annotation in (bool, int, float, str, Path) or parsed:
        return annotation, False
    raise TypeError(f"{name}: no flag type for {annotation} (give the option a parse function)")


def add_options(parser: argparse.ArgumentParser, config: type, *, skip: tuple[str, ...] = ()) -> None:
    """Adds a flag for every flagged field of ``config`` but ``skip``, under its group's heading."""
    groups: dict[str | None, Any] = {None: parser}
    for o in options(config):
        if o.field.name in skip:
            continue
        where = groups.get(o.spec.group)
        if where is None:
            where = groups[o.spec.group] = parser.add_argument_group(o.spec.group)
        kwargs: dict[str, Any] = {"dest": o.field.name, "help": o.spec.help}
        if o.kind is bool:
            kwargs.update(action=argparse.BooleanOptionalAction, default=o.default())
        else:
            metavar = o.spec.metavar or (o.flag[2:].replace("-", "_").upper() if o.repeated else None)
            kwargs.update(type=o.spec.parse or o.kind, metavar=metavar, choices=o.spec.choices)
            if o.repeated:
                kwargs.update(action="append", default=None)  # argparse appends to a default list: None, then ()
            elif o.required:
                kwargs.update(required=True)
            elif o.computed:
                kwargs.update(default=None)  # made when the config is (its help says what it will be)
            else:
                kwargs.update(default=o.default())
        where.add_argument(o.flag, **kwargs)


def from_args(config: type, args: argparse.Namespace, **more: Any) -> Any:
    """``config`` built from the flags ``add_options`` added (repeated flags as tuples) and ``more``."""
    values = {}
    for o in options(config):
        if not hasattr(args, o.field.name):
            continue
        value = getattr(args, o.field.name)
        if value is None and (o.computed or o.repeated):
            continue  # the field's own default (a repeated flag given no time, a default made when built)
        values[o.field.name] = tuple(value) if o.repeated else value
    return config(**values, **more)


def to_argv(config: Any, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that give back ``config`` from its defaults: one per field whose value is not its default."""
    argv: list[str] = []
    for o in options(type(config)):
        value = getattr(config, o.field.name)
        # a default made when the config is built (from the environment, say) is passed as it was made here
        if o.field.name in skip or (not o.required and not o.computed and value == o.default()):
            continue
        if o.kind is bool:
            argv.append(o.flag if value else "--no-" + o.flag[2:])
        elif o.repeated:
            if value == () and o.default() != ():
                raise ValueError(f"{o.flag}: no flag gives an empty {o.field.name} when its default is not empty")
            argv += [f"{o.flag}={o.spec.show(item)}" for item in value]
        elif value is None:
            raise ValueError(f"{o.flag}: no flag gives None when its default is {o.default()!r}")
        else:
            argv.append(f"{o.flag}={o.spec.show(value)}")  # "=": a value may begin with "-"
    return argv
