"""Settings declared with msgspec, a leaf below ``config.py``: a field's annotation says what it
accepts (``Annotated[int, Meta(ge=1, le=1024)]``, ``Literal["on", "off"]``, ``Bool``, ``Str``) and
``check`` holds every declared field of a config to it, naming the key and what it expects:

    lease_ttl_ms: expected a number in [10, 3600000], got 5
    placement_policy: expected 'local_first', 'spread' or 'random', got 'nearest'

``NUMBER`` marks an integer setting that also takes a float within its range (as JSON files have
always been allowed to give); without it an integer setting takes integers only. What depends on
more than one field, or needs a parser of its own (sizes, URLs, log levels), stays a small explicit
function beside the config (``config.py``), run after ``check``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import inspect

from .errors import ConfigError

NUMBER = msgspec.Meta(extra={"number": True})   # an integer setting that also takes a float in range
CHECKED = msgspec.Meta()                         # a declaration without a range: the type is checked
Bool = Annotated[bool, CHECKED]
Str = Annotated[str, CHECKED]


def _info(hint: Any) -> tuple[inspect.Type, dict[str, Any]]:
    """msgspec's view of a declaration, and the ``extra`` of its ``Meta`` (where ``NUMBER`` shows)."""
    info = inspect.type_info(hint)
    if isinstance(info, inspect.Metadata):
        return info.type, info.extra or {}
    return info, {}


def expects(hint: Any) -> str:
    """What a declaration accepts, in words (the middle of every message ``check`` raises)."""
    info, extra = _info(hint)
    match info:
        case inspect.BoolType():
            return "expected true or false"
        case inspect.IntType() | inspect.FloatType():
            whole = isinstance(info, inspect.IntType) and not extra.get("number")
            what = "an integer" if whole else "a number"
            lo, hi = info.ge, info.le
            if lo is not None and hi is not None:
                return f"expected {what} in [{lo}, {hi}]"
            return f"expected {what}" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")
        case inspect.LiteralType():   # in the order declared (msgspec sorts them)
            words = [repr(v) for v in typing.get_args(typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated
                                                      else hint)]
            return "expected " + (f"{', '.join(words[:-1])} or {words[-1]}" if len(words) > 1 else words[0])
        case inspect.StrType():
            return "expected a string"
    return f"expected {hint}"


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of each field of the config dataclass ``cls`` (read once per class)."""
    if cls not in _FIELD_TYPES:
        hints = typing.get_type_hints(cls, include_extras=True)
        _FIELD_TYPES[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _FIELD_TYPES[cls]


def declarations(cls: type) -> list[tuple[str, Any]]:
    """(key, declaration) of the fields ``check`` holds to theirs: those annotated with ``Annotated``
    (a range, or ``Bool``/``Str``) or ``Literal``. A field with a plain annotation is accepted as given
    (memcache_hybrid keys kept for compatibility) or checked by a rule of its own (sizes, URLs)."""
    return [(k, h) for k, h in field_types(cls).items() if typing.get_origin(h) in (Annotated, Literal)]


def check_value(key: str, hint: Any, value: Any) -> None:
    """Raise ConfigError naming ``key`` if ``value`` is not what ``hint`` declares."""
    info, extra = _info(hint)
    if isinstance(info, inspect.IntType) and extra.get("number") and isinstance(value, float):
        hint = typing.Annotated[float, msgspec.Meta(ge=info.ge, le=info.le)]
    try:
        msgspec.convert(value, hint)
    except msgspec.ValidationError:
        raise ConfigError(f"{key}: {expects(hint)}, got {value!r}") from None


def check(cfg: Any) -> None:
    """Every field of ``cfg`` against its declaration, in the order they are declared."""
    for key, hint in declarations(type(cfg)):
        check_value(key, hint, getattr(cfg, key))


def env_kind(hint: Any) -> str:
    """How an environment variable's text becomes this field's value: ``bool``, ``int``, ``float``,
    ``str`` (strings, choices, and sizes, which take ``"32GB"``), or ``other`` (not settable there)."""
    info, _ = _info(hint)
    match info:
        case inspect.BoolType():
            return "bool"
        case inspect.IntType():
            return "int"
        case inspect.FloatType():
            return "float"
        case inspect.StrType() | inspect.LiteralType():
            return "str"
        case inspect.UnionType() if any(isinstance(t, inspect.StrType) for t in info.types):
            return "str"
    return "other"
