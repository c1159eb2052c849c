"""Stage: config. Command-line flags, their help and defaults, value checks and the one-line repro,
all generated from a config dataclass's fields, so each field is declared once: its type, its
default, the docstring under it, and `knob(...)` metadata where the command line differs from
the plain rule (`--field-name`, parsed by its type).

Help is the field's docstring: the text before its `None:` clause says what the field is, the
clause what leaving it unset means, shown as the flag's default; a field whose default is not
None shows that value. Types: int, float, str, bool (yes/no), tuple[int, ...] (comma-separated),
Literal[...] (choices), each optionally `| None`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal, Union


@dataclass(kw_only=True, frozen=True)
class Flag:
    """How a field appears on the command line and which values are valid, where that is more
    than its type says."""

    name: str | None = None
    """The flag ('--timeout' for timeout_s); None: '--' and the field name with dashes."""
    none: str | None = None
    """The argument that stands for None ('0' for no clipping); None: None has no spelling."""
    min: float | None = None
    """Smallest valid value (of each element, for a tuple), checked on the command line and
    when the dataclass is made."""
    positive: bool = False
    """A finite number > 0."""


def knob(default: Any = None, **flag: Any) -> Any:
    """A config field with its default and `Flag` (name, none, min, positive)."""
    return field(default=default, metadata={"flag": Flag(**flag)})


@dataclass(kw_only=True, frozen=True)
class Spec:
    """One field as the generator reads it."""

    name: str
    flag: Flag
    kind: type
    """int, float, str, bool or tuple (of ints)."""
    choices: tuple | None
    default: Any
    """dataclasses.MISSING for a required field."""
    doc: str

    @property
    def option(self) -> str:
        return self.flag.name or "--" + self.name.replace("_", "-")


@cache
def docstrings(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it, whitespace collapsed; a subclass's wins."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                out[node.target.id] = " ".join(nxt.value.value.split())
    return out


@cache
def specs(cls: type) -> tuple[Spec, ...]:
    hints = typing.get_type_hints(cls)
    docs = docstrings(cls)
    out = []
    for f in dataclasses.fields(cls):
        # a subclass that only changes a default keeps the Flag declared with the field
        declared: list[dict[str, dataclasses.Field]] = [getattr(k, "__dataclass_fields__", {}) for k in cls.__mro__]
        flag = next((fs[f.name].metadata["flag"] for fs in declared
                     if f.name in fs and "flag" in fs[f.name].metadata), Flag())
        kind, choices = _kind(hints[f.name])
        out.append(Spec(name=f.name, flag=flag, kind=kind, choices=choices, default=f.default, doc=docs.get(f.name, "")))
    return tuple(out)


def _kind(tp: Any) -> tuple[type, tuple | None]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        return type(choices[0]), choices
    if typing.get_origin(tp) is tuple:
        return tuple, None
    return tp, None


def to_arg(value: Any) -> str:
    """A value as the command line spells it: floats by repr (they parse back bit for bit)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return repr(value) if isinstance(value, float) else str(value)


def check_values(obj: Any) -> None:
    """ValueError naming the field, the value and what is valid, for each declared rule."""
    cls: type = type(obj)  # annotated: mypy finds type(obj) not Hashable for the cache
    for s in specs(cls):
        value = getattr(obj, s.name)
        if value is None:
            continue
        if s.choices is not None and value not in s.choices:
            raise ValueError(f"{s.name} must be one of {s.choices}, got {value!r}")
        if s.flag.positive and (not math.isfinite(value) or value <= 0):
            raise ValueError(f"{s.name} must be a finite number > 0, got {value}")
        low = s.flag.min
        if low is not None and any(v < low for v in (value if isinstance(value, tuple) else (value,))):
            raise ValueError(f"{s.name} must be >= {low:g}, got {to_arg(value)}")


def _parse(s: Spec):
    def convert(text: str) -> Any:
        try:
            if s.kind is tuple:
                return tuple(int(x) for x in text.split(","))
            return int(text) if s.kind is int else s.kind(text)
        except ValueError:
            what = "comma-separated whole numbers like 4,4,2" if s.kind is tuple else (
                "a whole number" if s.kind is int else f"a {s.kind.__name__}")
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None

    try:  # '0' for a float also stands for 0.0
        none_value = None if s.flag.none is None else convert(s.flag.none)
    except argparse.ArgumentTypeError:
        none_value = None

    def parse(text: str) -> Any:
        if s.kind is bool:
            if text not in ("yes", "no"):
                raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")
            return text == "yes"
        if s.flag.none is not None and text == s.flag.none:
            return None
        value = convert(text)
        if none_value is not None and value == none_value:
            return None
        low = s.flag.min
        if low is not None and any(v < low for v in (value if isinstance(value, tuple) else (value,))):
            raise argparse.ArgumentTypeError(f"must be >= {low:g}, got {text!r}" if s.kind is tuple
                                             else f"must be >= {low:g}, got {value}")
        return value

    return parse


def help_text(s: Spec, fallbacks: typing.Mapping[str, Any] = {}) -> str:
    """The flag's help: the docstring's meaning, then the default (see the module docstring)."""
    meaning, _, unset = s.doc.partition("None: ")
    meaning, unset = meaning.rstrip(" .;,"), unset.rstrip(" .")
    if s.default is dataclasses.MISSING:
        return meaning
    if s.default is None:
        if s.name in fallbacks:
            unset += f", else {to_arg(fallbacks[s.name])}"
        return f"{meaning} (default: {unset})" if unset else meaning
    extra = f"; {s.flag.none} means {unset}" if s.flag.none is not None and unset else ""
    shown = f"{s.default:g}" if isinstance(s.default, float) else to_arg(s.default)
    return f"{meaning} (default {shown}{extra})"


def add_flags(parser: Any, cls: type, *, only: typing.Iterable[str] | None = None,
              fallbacks: typing.Mapping[str, Any] = {}) -> None:
    """One flag per field of `cls` (of `only`, in the class's order); `fallbacks`: what a None
    default becomes when no one else fills it (named in the help)."""
    keep = None if only is None else set(only)
    for s in specs(cls):
        if keep is not None and s.name not in keep:
            continue
        kwargs: dict[str, Any] = dict(dest=s.name, help=help_text(s, fallbacks).replace("%", "%%"))
        if s.kind is bool:
            # a bare `--train-step` means yes; `--forward-only no` still spells the other value
            kwargs.update(metavar="{yes,no}", nargs="?", const=True)
        if s.choices is not None:
            kwargs["choices"] = s.choices
        else:
            kwargs["type"] = _parse(s)
        if s.default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = s.default
        parser.add_argument(s.option, **kwargs)


def from_args(cls: type, args: argparse.Namespace, **changes: Any) -> Any:
    """`cls` from parsed flags (those `add_flags` made; fields without one keep their default)."""
    given = {s.name: getattr(args, s.name) for s in specs(cls) if hasattr(args, s.name)}
    return cls(**{**given, **changes})


def repro_args(obj: Any, default: Any, *, keep: typing.Container[str] = ()) -> list[str]:
    """The flags that make `default` into `obj`: each field that differs (or is in `keep`); a
    None that has no spelling on the command line is left to the rerun's own default."""
    out: list[str] = []
    cls: type = type(obj)  # annotated: mypy finds type(obj) not Hashable for the cache
    for s in specs(cls):
        value = getattr(obj, s.name)
        if s.name not in keep and (value == getattr(default, s.name) or (value is None and s.flag.none is None)):
            continue
        if value is None:
            assert s.flag.none is not None, f"kept field {s.name} is None and None has no spelling"
            out += [s.option, s.flag.none]
        else:
            out += [s.option, to_arg(value)]
    return out
