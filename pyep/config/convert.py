"""Plain tree -> schema dataclasses, type-checked against the field annotations.

Only the few type shapes the schema uses are supported (int, float, str, bool, Text, Optional, Union,
Literal, List, Dict, nested dataclasses); anything else is a programming error in the schema, raised
as TypeError. Every user mistake becomes a Problem naming its key and line, and conversion keeps going
so that one run reports all of them.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Dict, List, Tuple

from .schema import SHORTHAND, SlurmTime, Text
from .source import Locations, Path, Problem

_NONE = type(None)


class _Fail(Exception):
    """A value did not fit a type; the message says what was expected."""


def describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Text:
        return "a string or number"
    if tp is SlurmTime:
        return "a quoted Slurm time"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, List):
        return f"a list of {describe(typing.get_args(tp)[0])} values"
    if origin in (dict, Dict):
        k, v = typing.get_args(tp)
        return f"a mapping of {describe(k)} to {describe(v)}"
    if origin is typing.Union:
        parts = [describe(a) for a in typing.get_args(tp) if a is not _NONE]
        if _NONE in typing.get_args(tp):
            parts.append("null")
        return " or ".join(parts)
    raise TypeError(f"schema uses an unsupported type {tp!r}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def suggest(word: str, choices: List[str]) -> str:
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def convert(value: Any, tp: Any, path: Path, locs: Locations, problems: List[Problem]) -> Any:
    """Convert `value` to `tp`; on a mismatch record a Problem and return None."""
    try:
        return _convert(value, tp, path, locs, problems)
    except _Fail as exc:
        problems.append(locs.problem(path, str(exc)))
        return None


def _convert(value: Any, tp: Any, path: Path, locs: Locations, problems: List[Problem]) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _dataclass(value, tp, path, locs, problems)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Fail(f"expected true or false, got {_shown(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Fail(f"expected an integer, got {_shown(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Fail(f"expected a number, got {_shown(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Fail(f"expected a string, got {_shown(value)}")
    if tp is SlurmTime:
        if isinstance(value, str):
            return value
        raise _Fail(f"expected a quoted time such as '01:00:00', got {_shown(value)} (YAML reads an unquoted "
                    "H:MM:SS as a number of seconds)")
    if tp is Text:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Fail(f"expected a string or number, got {_shown(value)} (quote it if it is meant as text)")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[0]):
            return value
        raise _Fail(f"{_shown(value)} is not one of {', '.join(repr(c) for c in choices)}"
                    + suggest(str(value), [str(c) for c in choices]))
    if origin in (list, List):
        if not isinstance(value, list):
            raise _Fail(f"expected {describe(tp)}, got {_shown(value)}")
        (item_tp,) = typing.get_args(tp)
        return [convert(v, item_tp, path + (i,), locs, problems) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise _Fail(f"expected {describe(tp)}, got {_shown(value)}")
        key_tp, val_tp = typing.get_args(tp)
        out: Dict[Any, Any] = {}
        for k, v in value.items():
            try:
                kk = _convert(k, key_tp, path + (k,), locs, problems)
            except _Fail:
                problems.append(locs.problem(path + (k,), f"key {k!r} must be {describe(key_tp)}"))
                continue
            out[kk] = convert(v, val_tp, path + (k,), locs, problems)
        return out
    if origin is typing.Union:
        members = typing.get_args(tp)
        if value is None:
            if _NONE in members:
                return None
            raise _Fail(f"expected {describe(tp)}, got null")
        real = [m for m in members if m is not _NONE]
        if len(real) == 1:     # Optional[X]: X's own message (with its suggestions) is the clearest
            return _convert(value, real[0], path, locs, problems)
        for member in real:
            trial: List[Problem] = []
            try:
                result = _convert(value, member, path, locs, trial)
            except _Fail:
                continue
            if trial and _matches_shape(value, member):
                problems.extend(trial)     # right shape, wrong contents: report the details
                return result
            if not trial:
                return result
        raise _Fail(f"expected {describe(tp)}, got {_shown(value)}")
    raise TypeError(f"schema uses an unsupported type {tp!r} at {path}")


def _matches_shape(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (list, List):
        return isinstance(value, list)
    if origin in (dict, Dict) or dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    return False


def _dataclass(value: Any, cls: type, path: Path, locs: Locations, problems: List[Problem]) -> Any:
    if value is None:
        value = {}
    if isinstance(value, str) and cls in SHORTHAND:
        value = {SHORTHAND[cls]: value}
    if not isinstance(value, dict):
        raise _Fail(f"expected a mapping (section), got {_shown(value)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: Dict[str, Any] = {}
    for key, raw in value.items():
        if key not in fields:
            problems.append(locs.problem(path + (key,), "unknown key" + suggest(str(key), list(fields))
                                         + f" (valid keys: {', '.join(fields)})"))
            continue
        converted = convert(raw, hints[key], path + (key,), locs, problems)
        if converted is not None or raw is None:
            kwargs[key] = converted
    return cls(**kwargs)


def to_plain(obj: Any) -> Any:
    """Dataclass tree -> YAML-safe plain tree (the inverse of conversion; used for resolved configs)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def field_paths(cls: type, prefix: Path = ()) -> List[Tuple[Path, Any]]:
    """Every scalar-ish field of the schema with its type (for docs and tests)."""
    out: List[Tuple[Path, Any]] = []
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out.extend(field_paths(tp, prefix + (name,)))
        else:
            out.append((prefix + (name,), tp))
    return out
