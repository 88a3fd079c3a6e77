"""Typed options: a dataclass field that is also a command-line flag, and the parsers and argv generated from them.

Contract:
- `option(*names, default=..., help=..., choices=..., parse=..., show=..., kind=..., dest=...)` is a
  `dataclasses.field` whose metadata carries a `Flag`: its names (the first is the one `to_argv` writes, the others
  are aliases), help, choices, how its text becomes the value (`parse`, argparse's `type`) and back (`show`), and
  its kind: "value" (`--x V`), "switch" (`--x` sets True), "toggle" (`--x` / `--no-x`), "off" (`--no-x` sets
  False), "list" (`--x A B ...`, a tuple). A field without a default is a required flag. The default is the
  field's own: one default per flag, wherever its parser is built. `json_option` is a "value" option whose text is
  a JSON object the dataclass parses itself (`--speculative-config`); `to_argv` writes a parsed value back as JSON
  (its `to_json()`, else its fields).
- `section(cls, title, default=..., skip=...)` marks a field holding another options object (the engine's options
  inside a worker's); its flags join the parser under `title`, except the fields named in `skip` (set by whoever
  builds the object, e.g. the addresses the mesh plan assigns), which come from `default`.
- `add_options(parser, cls, skip=(), only=None)` adds the flags of `cls` and its sections; a flag shared by several
  sections (the same `Flag`, e.g. `--served-model-name` of both workers and the gateway) is added once and sets
  them all; two different flags with one destination are a `ValueError` (the tree must skip one).
- `from_namespace(cls, ns, skip=(), base=None, **given)` builds the object from parsed flags (`base`: the object
  whose skipped fields it keeps); `to_argv(obj)` is the flags that rebuild `obj` through its parser: every field
  whose value differs from its default, and every required one. So `from_namespace(cls, parse(to_argv(obj))) ==
  obj` for every object of flagged fields (tests/unit/deploy/test_options_tree.py).
- The flags several services declare alike are field factories here (`grace_option`, `address_option`,
  `log_level_option`,
  `metrics_port_option`, `served_model_name_option`, `torch_threads_option`, `load_remote_prefix_option`,
  `cache_address_option`): each is declared once and every service's parser gets the same flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass
from typing import Any

FLAG = "kdamesh.flag"
SECTION = "kdamesh.section"
KINDS = ("value", "switch", "toggle", "off", "list")
SHUTDOWN_GRACE_S = 5.0  # every service's default shutdown grace (seconds)


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    help: str = ""
    choices: tuple | None = None
    parse: Callable[[str], Any] | None = None
    show: Callable[[Any], str] = str
    kind: str = "value"
    dest: str | None = None  # None: the field's name
    metavar: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"flag {self.names[0]}: kind must be one of {KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class Section:
    cls: type
    title: str
    skip: tuple[str, ...] = ()
    aliases: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (field, more names) this parser also accepts


def option(*names: str, default: Any = MISSING, default_factory: Any = MISSING, help: str = "",  # noqa: A002
           choices: Iterable | None = None, parse: Callable[[str], Any] | None = None,
           show: Callable[[Any], str] = str, kind: str = "value", dest: str | None = None,
           metavar: str | None = None, repr: bool = True) -> Any:  # noqa: A002
    flag = Flag(tuple(names), help, None if choices is None else tuple(choices), parse, show, kind, dest, metavar)
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr, metadata={FLAG: flag})


def json_option(*names: str, help: str, default: Any = None) -> Any:  # noqa: A002
    """A flag whose text is a JSON object; the dataclass parses the text (or a dict) into its config type."""
    return option(*names, default=default, help=help, show=json_text, metavar="JSON")


def json_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if hasattr(value, "to_json"):
        return value.to_json()
    return json.dumps(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)


def section(cls: type, title: str, *, default: Any = MISSING, default_factory: Any = MISSING,
            skip: Iterable[str] = (), aliases: dict[str, tuple[str, ...]] | None = None) -> Any:
    sec = Section(cls, title, tuple(skip), tuple((aliases or {}).items()))
    return dataclasses.field(default=default, default_factory=default_factory, metadata={SECTION: sec})


# -- parsers -----------------------------------------------------------------------------------------------------


def flags_of(cls: type, skip: Iterable[str] = (), only: Iterable[str] | None = None):
    """(field, Flag) for each flagged field of `cls` (not its sections), in declaration order."""
    skip, only = set(skip), None if only is None else set(only)
    for f in dataclasses.fields(cls):
        if FLAG in f.metadata and f.name not in skip and (only is None or f.name in only):
            yield f, f.metadata[FLAG]


def sections_of(cls: type, skip: Iterable[str] = ()):
    skip = set(skip)
    for f in dataclasses.fields(cls):
        if SECTION in f.metadata and f.name not in skip:
            yield f, f.metadata[SECTION]


def add_options(parser, cls: type, skip: Iterable[str] = (), only: Iterable[str] | None = None,
                aliases: Iterable[tuple[str, tuple[str, ...]]] = ()) -> None:
    """Adds the flags of `cls` (and, unless `only` picks fields, of its sections) to a parser or argument group."""
    more = dict(aliases)
    for f, flag in flags_of(cls, skip, only):
        _add_flag(parser, f, dataclasses.replace(flag, names=flag.names + more[f.name]) if f.name in more else flag)
    if only is not None:
        return
    for f, sec in sections_of(cls, skip):
        group = parser.add_argument_group(sec.title) if isinstance(parser, argparse.ArgumentParser) else parser
        add_options(group, sec.cls, sec.skip, aliases=sec.aliases)


def _add_flag(parser, f: dataclasses.Field, flag: Flag) -> None:
    dest = flag.dest or f.name
    known = next((a for a in parser._actions if a.dest == dest), None)  # groups share their parser's actions
    if known is not None:
        if getattr(known, "flag", None) != flag:
            raise ValueError(f"{flag.names[0]} and {known.option_strings or [known.dest]} both set {dest!r}; "
                             "skip one of them")
        return
    kwargs: dict[str, Any] = {"dest": dest, "help": _help(f, flag)}
    if _required(f):
        kwargs["required"] = True
    else:
        kwargs["default"] = _default(f)
    if flag.kind == "switch":
        kwargs["action"] = "store_true"
    elif flag.kind == "off":
        kwargs["action"] = "store_false"
    elif flag.kind == "toggle":
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=flag.parse, choices=flag.choices, metavar=flag.metavar)
        if flag.kind == "list":
            kwargs["nargs"] = "+"
    parser.add_argument(*flag.names, **kwargs).flag = flag


def _help(f: dataclasses.Field, flag: Flag) -> str:
    if flag.kind in ("switch", "off", "toggle") or _required(f) or "default" in flag.help:
        return flag.help
    shown = "unset" if _default(f) is None else _default(f)
    return f"{flag.help} (default: {shown})" if flag.help else f"default: {shown}"


# -- objects from flags, flags from objects -------------------------------------------------------------------------


def from_namespace(cls: type, ns: argparse.Namespace, skip: Iterable[str] = (), base: Any = None, **given: Any):
    """The `cls` object of the parsed flags; `base` supplies the skipped fields, `given` the unflagged ones."""
    values = dict(given)
    for f, flag in flags_of(cls, skip):
        value = getattr(ns, flag.dest or f.name)
        values[f.name] = tuple(value) if flag.kind == "list" else value
    for f, sec in sections_of(cls, skip):
        inner = getattr(base, f.name) if base is not None else _default(f)
        values[f.name] = from_namespace(sec.cls, ns, sec.skip, base=inner if sec.skip else None)
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def to_argv(obj: Any, skip: Iterable[str] = ()) -> list[str]:
    """The flags that rebuild `obj` through its parser (see the module docstring)."""
    argv: list[str] = []
    for f, flag in flags_of(type(obj), skip):
        value = getattr(obj, f.name)
        if _required(f) or value != _default(f):
            argv += _flag_argv(flag, value)
    for f, sec in sections_of(type(obj), skip):
        argv += to_argv(getattr(obj, f.name), sec.skip)
    return argv


def _required(f: dataclasses.Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return None if f.default_factory is MISSING else f.default_factory()


def _flag_argv(flag: Flag, value: Any) -> list[str]:
    name = flag.names[0]
    if flag.kind == "switch":
        return [name] if value else []
    if flag.kind == "off":
        return [] if value else [name]
    if flag.kind == "toggle":
        return [name if value else "--no-" + name[2:]]
    if flag.kind == "list":
        return [name, *map(flag.show, value)] if value else []
    return [] if value is None else [name, flag.show(value)]


# -- the flags several services declare alike ------------------------------------------------------------------------


def log_level_option() -> Any:
    return option("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def address_option(default: str) -> Any:
    return option("--address", default=default, help="host:port to listen on (port 0: a free port)")


def grace_option(dest: str | None = "grace_s") -> Any:
    return option("--grace-s", default=SHUTDOWN_GRACE_S, dest=dest, parse=float,
                  help="on SIGTERM/SIGINT: how long calls and streams in flight get to finish (seconds)")


def metrics_port_option() -> Any:
    return option("--metrics-port", default=None, parse=int,
                  help="serve Prometheus /metrics on this HTTP port (on the --address host; 0: a free port); "
                       "default: none")


def served_model_name_option() -> Any:
    return option("--served-model-name", default=None,
                  help="the name clients use for the model (default: the model folder's name)")


def torch_threads_option() -> Any:
    return option("--torch-threads", default=None, parse=int,
                  help="torch intra-op threads of each worker process (default: torch's)")


def load_remote_prefix_option() -> Any:
    return option("--load-remote-prefix", default=True, kind="toggle",
                  help="workers import cached prefixes (blocks + snapshot) from the cache service before computing "
                       "(off: each worker's own cache only; the gateway's routing then decides every hit)")


def cache_address_option(help: str, default: Any = MISSING) -> Any:  # noqa: A002
    return option("--cache-address", default=default, help=help)
