"""What every step config shares: fields checked by their types when built, and the target model.

A step's settings are a frozen `<Step>Options` dataclass in its stage's config module
(remote/<stage>/config.py): the user-facing fields, their only defaults, a docstring per field. Its
`<Step>Config(<Step>Options)` adds the run's wiring (paths, this host's part). Both derive from
Checked, whose __post_init__ checks every field against its annotation and its bounds (field
metadata ge/gt/le/lt/pattern: the names pydantic reads, so the flow's form shows them too) and names
the key and what was expected:

    max_length: expected an integer >= 16, got '512' (a string)

The flow's parameter groups are these Options classes: pydantic reads stdlib dataclasses, and
`__pydantic_config__` makes the field docstrings the form's descriptions and refuses unknown keys.
Standard library only: the controller imports this without torch or vLLM.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from typing import Any, Literal

_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "an object",
          type(None): "null", list: "a list", tuple: "a list"}
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


class ConfigError(ValueError):
    """A config field holds a value of the wrong type or outside its bounds (the message names it)."""


def bounded(default: Any, **bounds: Any) -> Any:
    """A field's default with its bounds (ge, gt, le, lt; pattern for text), checked by Checked."""
    return dataclasses.field(default=default, metadata=bounds)


class Checked:
    """Base of every step config: each field is checked against its type and bounds when built."""

    __pydantic_config__ = {"use_attribute_docstrings": True, "extra": "forbid"}

    def __post_init__(self) -> None:
        check_fields(self)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # pydantic reads the docstrings of a class's own fields only: the inherited ones carry theirs
        # as field metadata (set here, once the parent is a dataclass)
        super().__init_subclass__(**kwargs)
        for base in cls.__mro__[1:]:
            if dataclasses.is_dataclass(base):
                _describe(base)


@functools.cache
def _describe(cls: type) -> None:
    """Copy the docstring under each of cls's own fields into the field's metadata (description)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen build): the form goes without descriptions
        return
    body = tree.body[0].body
    for field_node, doc in zip(body, body[1:]):
        if (isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str) and field_node.target.id in cls.__dict__.get("__dataclass_fields__", {})):
            f = cls.__dataclass_fields__[field_node.target.id]
            f.metadata = types.MappingProxyType({**f.metadata, "description": inspect.cleandoc(doc.value.value)})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(obj: Any) -> None:
    """Check (and normalise: a list for a tuple, an int for a float) every field of a dataclass."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        ok, value = _conform(value, hints[f.name])
        if not ok or not _within(value, f.metadata):
            raise ConfigError(_refusal(f.name, value, hints[f.name], f.metadata))
        object.__setattr__(obj, f.name, value)


def _refusal(name: str, value: Any, tp: Any, bounds: typing.Mapping) -> str:
    if typing.get_origin(tp) is Literal:  # a choice: the key and the value, then the choices
        return f"{name} {value!r}: choose one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return f"{name}: expected {_expected(tp, bounds)}, got {_shown(value)}"


def _conform(value: Any, tp: Any) -> tuple[bool, Any]:
    """(whether value is of type tp, value normalised to it)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, v = _conform(value, arg)
            if ok:
                return True, v
        return False, value
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp in (bool, str, type(None)):
        return isinstance(value, tp), value
    if (origin or tp) is dict:
        return isinstance(value, dict), value
    if dataclasses.is_dataclass(tp):  # a nested group of options (data.regenerate): its own checks run
        return (True, value) if isinstance(value, tp) else (isinstance(value, dict), tp(**value) if isinstance(value, dict) else value)
    if (origin or tp) in (list, tuple):
        return _conform_items(value, origin or tp, args)
    raise TypeError(f"no check for a field of type {tp!r}")  # a config field of a type this module does not know


def _conform_items(value: Any, kind: type, args: tuple) -> tuple[bool, Any]:
    if not isinstance(value, (list, tuple)):
        return False, value
    if kind is tuple and args and args[-1] is not Ellipsis:  # a fixed length: tuple[float, float]
        if len(value) != len(args):
            return False, value
        item_types = args
    else:
        item_types = (args[0] if args else Any,) * len(value)
    items = [_conform(v, t) for v, t in zip(value, item_types)]
    if not all(ok for ok, _ in items):
        return False, value
    return True, kind(v for _, v in items)


def _within(value: Any, bounds: typing.Mapping) -> bool:
    if isinstance(value, str) and "pattern" in bounds:
        return re.search(bounds["pattern"], value) is not None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return True
    return all(_holds(value, op, bounds[op]) for op in _BOUNDS if op in bounds)


def _holds(value: float, op: str, limit: float) -> bool:
    return {"ge": value >= limit, "gt": value > limit, "le": value <= limit, "lt": value < limit}[op]


def _expected(tp: Any, bounds: typing.Mapping) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_expected(a, bounds) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if (origin or tp) in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} " + " and ".join(_plural(a) for a in dict.fromkeys(args))
        return "a list" + (f" of {_plural(args[0])}" if args else "")
    name = _NAMES.get(origin or tp, repr(tp))
    limits = [f"{_BOUNDS[op]} {bounds[op]}" for op in _BOUNDS if op in bounds and tp in (int, float)]
    if tp is str and "pattern" in bounds:
        limits.append(f"matching {bounds['pattern']}")
    return " ".join([name, " and ".join(limits)]).strip()


def _plural(tp: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(tp, repr(tp))


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return repr(value)
    kind = "a string" if isinstance(value, str) else _NAMES.get(type(value), type(value).__name__)
    return f"{value!r} ({kind})"


def require_paths(obj: Any, name: str) -> None:
    """Refuse an empty list of paths (or one with an empty path) in the field `name` of a config."""
    value = getattr(obj, name)
    if not value or not all(value):
        raise ConfigError(f"{name}: expected a non-empty list of paths, got {value!r}")


def pick(options: type, source: Any) -> dict[str, Any]:
    """The fields of the dataclass `options` taken from `source` (an Options object that holds them)."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(options)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetOptions(Checked):
    """The target model, as the flow names it; each step's config takes the parts it needs."""

    model: str = ""
    """HF model folder of the target on the host; empty: the embedded SmolLM2-135M-Instruct"""
    revision: str = ""
    """a label for the target's weights (part of the capture cache key); empty: hash of its config and index"""
    trust_remote_code: bool = False
    """let transformers run the target's own code (Kimi-K2.5's tokenizer needs it)"""
