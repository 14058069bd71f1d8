"""How every config section is read: the section's dataclass is the typed model, and pydantic
validates a YAML/JSON mapping against it, collecting every problem with its path.

* Unknown keys are refused (``router.draft_depth.smaples: unknown key; did you mean "samples"?``).
* Types are strict, as in JSON: ``"2"`` or ``true`` is not an integer, ``1.5`` is not one either;
  an integer is a number.
* A value's rules are its field's type (``PositiveInt``, :data:`Fraction`, ``Literal[...]``): the
  JSON schema shows them, and :func:`check_fields` holds a section built in code to them too. Rules
  across keys (``min_ngram <= max_ngram``) stay in a class's ``__post_init__``, which runs inside
  the same validation: one :class:`ConfigError` lists every section's problems, not only the first.

The classes stay plain dataclasses (the code reads their attributes and tests construct them
directly); pydantic only reads them here. A dataclass may keep some of its fields flat in the file:
``__flat_field__ = "worker"`` on ``cluster.config.PoolConfig`` means its ``worker`` field's keys are
written beside the pool's own (its caller nests them before :func:`validate`); paths in errors and
the JSON schema (:func:`json_schema`) show the flat form.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import types
import typing
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

__all__ = ["ConfigError", "Port", "Fraction", "validate", "check_fields", "json_schema"]

Port = Annotated[int, Field(ge=0, le=65535)]  # 0: any free port
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]  # a share, a utilization

_FORBID = {"extra": "forbid"}  # pydantic's ConfigDict, inherited by every nested dataclass


class ConfigError(ValueError):
    """Every problem of a config, one line each, with its path (``target.replicas: ...``)."""

    def __init__(self, problems: list[str], where: str = ""):
        self.problems = list(problems)
        head = f"{where}: " if where else ""
        if len(self.problems) == 1:
            super().__init__(head + self.problems[0])
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            super().__init__(f"{head}{len(self.problems)} problems:\n{lines}")


@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    # A wrapper carries the config: a dataclass of another module (KPolicy) has none of its own.
    wrapper = dataclasses.make_dataclass(f"{cls.__name__}Section", [("value", cls)])
    wrapper.__pydantic_config__ = _FORBID
    return TypeAdapter(wrapper)


def _plain(value: Any) -> Any:
    """JSON form of what a caller may pass inside a mapping: an already-built section."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, set | tuple):
        return list(value)
    raise TypeError(f"not a config value: {value!r}")


def validate(cls: type, data: Any, where: str = "") -> Any:
    """``data`` (a mapping, as read from YAML) validated into dataclass ``cls``; ``where`` is the
    section's path (``router.draft_depth``) that error paths start with."""
    if data is None:
        data = {}
    try:
        text = json.dumps({"value": data}, default=_plain)
    except (TypeError, ValueError) as exc:
        raise ConfigError([str(exc)], where) from None
    try:
        return _adapter(cls).validate_json(text, strict=True).value
    except ValidationError as exc:
        root = [p for p in where.split(".") if p]
        raise ConfigError([_problem(cls, root, err) for err in exc.errors()]) from None


def check_fields(obj: Any, where: str = "") -> None:
    """The constraints a dataclass's annotations declare (``PositiveInt``, ``Literal[...]``), checked
    on an instance built directly (``RouterConfig(max_queue=0)``), as the model checks a file's: a
    class calls it from ``__post_init__``, so each rule is written once, in its field's type."""
    problems = []
    for name, adapter in _constrained_fields(type(obj)):
        try:
            adapter.validate_python(getattr(obj, name), strict=True)
        except ValidationError as exc:
            problems += [_line(f"{where}.{name}" if where else name, err, []) for err in exc.errors()]
    if problems:
        raise ConfigError(problems)


@functools.cache
def _constrained_fields(cls: type) -> tuple[tuple[str, TypeAdapter], ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple((f.name, TypeAdapter(hints[f.name])) for f in dataclasses.fields(cls) if _constrained(hints[f.name]))


def _constrained(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Annotated, typing.Literal):
        return True
    return origin in (typing.Union, types.UnionType) and any(_constrained(a) for a in typing.get_args(tp))


# --------------------------------------------------------------------------- error lines


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass a field's type names (``PoolConfig | None`` -> PoolConfig), if any."""
    if isinstance(tp, dataclasses.InitVar):
        tp = tp.type
    for t in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(t):
            return t
    return None


def _keys(cls: type) -> list[str]:
    hints = _hints(cls)
    return [k for k, tp in hints.items() if not k.startswith("_") and typing.get_origin(tp) is not typing.ClassVar]


def _walk(cls: type, loc: tuple) -> tuple[list[str], list[str], type | None]:
    """(the path as the file writes it, the keys known where it ends, the dataclass there) for a
    pydantic error ``loc`` below ``cls`` (flat fields left out of the path, their keys counted as
    the parent's)."""
    path: list[str] = []
    known: list[str] = _keys(cls)
    current: type | None = cls
    for part in loc:
        if isinstance(part, int):
            path[-1:] = [f"{path[-1]}[{part}]"] if path else [f"[{part}]"]
            continue
        nxt = _dataclass_in(_hints(current).get(part)) if current is not None else None
        flat = current is not None and getattr(current, "__flat_field__", None) == part
        if not flat:
            path.append(part)
        if flat and nxt is not None:
            known = [k for k in known if k != part] + _keys(nxt)
        else:
            known = _keys(nxt) if nxt is not None else []
        current = nxt
    return path, known, current


def _shown(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "dict": "a mapping",
    "dataclass": "a mapping",
    "list": "a list",
}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _unknown(where: str, key: str, known: list[str], section: type | None) -> str:
    """An unknown key's line, with the closest known key; keys a section moved elsewhere
    (``__moved_keys__``, RebalanceConfig's older ones) are suggested where they live now."""
    moved = dict(getattr(section, "__moved_keys__", {}))
    close = difflib.get_close_matches(key, [*known, *moved], n=1, cutoff=0.6)
    if not close:
        return f"{where}: unknown key"
    return f'{where}: unknown key; did you mean "{moved.get(close[0], close[0])}"?'


def _problem(cls: type, root: list[str], err: dict) -> str:
    loc = tuple(err["loc"])[1:]  # [0] is the wrapper's field
    if err["type"] == "unexpected_keyword_argument":
        path, known, section = _walk(cls, loc[:-1])
        return _unknown(".".join([*root, *path, str(loc[-1])]), str(loc[-1]), known, section)
    path, known, _ = _walk(cls, loc)
    return _line(".".join([*root, *path]) or "config", err, known)


def _line(where: str, err: dict, known: list[str]) -> str:
    """One problem of the value at ``where`` (``known``: the keys of the section it is)."""
    kind, value = err["type"], err.get("input")
    base = kind.removesuffix("_type").removesuffix("_parsing").removesuffix("_from_float")
    if base in _EXPECTED:
        return f"{where}: expected {_EXPECTED[base]}, got {_shown(value)}"
    if kind in ("missing", "missing_argument"):
        return f"{where}: required"
    if kind in _BOUNDS:
        bound = next(iter(err.get("ctx", {}).values()), "?")
        return f"{where}: must be {_BOUNDS[kind]} {bound}, got {_shown(value)}"
    if kind == "string_too_short":
        return f"{where}: must not be empty"
    if kind == "literal_error":
        return f"{where}: must be one of {err.get('ctx', {}).get('expected', '?')}, got {_shown(value)}"
    if kind == "value_error":
        msg = str(err["msg"]).removeprefix("Value error, ")
        head = msg.split(":", 1)[0]
        if head.isidentifier() and head in known:  # "dtype: must be one of ...": a field of this section
            return f"{where}.{msg}"
        return msg if msg.startswith(where) or where == "config" else f"{where}: {msg}"
    return f"{where}: {err['msg']}"


# --------------------------------------------------------------------------- JSON schema


def json_schema(cls: type, title: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``cls`` as a file writes it (flat fields inlined)."""
    wrapper = _adapter(cls).json_schema()
    defs = wrapper.pop("$defs", {})
    top = wrapper["properties"]["value"]
    name = top["$ref"].rsplit("/", 1)[-1]
    out = dict(defs.pop(name))
    _inline_flat(cls, defs, out, set())
    used = {d: v for d, v in defs.items() if f'"#/$defs/{d}"' in json.dumps([out, *defs.values()])}
    if used:
        out["$defs"] = used
    out["title"] = title
    out["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return out


def _inline_flat(cls: type, defs: dict, schema: dict, seen: set) -> None:
    """Put a flat field's properties beside its parent's, in every definition below ``cls``."""
    if cls in seen:
        return
    seen.add(cls)
    flat = getattr(cls, "__flat_field__", None)
    props = schema.get("properties", {})
    if flat and flat in props:
        inner = props.pop(flat)
        ref = inner.get("$ref", "").rsplit("/", 1)[-1]
        inner_schema = defs.get(ref, inner)
        props.update(inner_schema.get("properties", {}))
        required = [r for r in schema.get("required", []) if r != flat] + inner_schema.get("required", [])
        schema["required"] = required
        if not required:
            schema.pop("required")
    for tp in _hints(cls).values():
        sub = _dataclass_in(tp)
        if sub is not None and sub.__name__ in defs:
            _inline_flat(sub, defs, defs[sub.__name__], seen)
