"""YAML text -> plain Python tree, keeping where every key and value came from.

PyYAML's `compose` gives nodes with marks; we walk them ourselves (constructing only scalars) so that
each path in the tree ("ep", "num_experts") remembers its line. Command-line overrides are merged into
the same tree and remember the override text instead. Errors then read
`configs/x.yaml:12: ep.num_experts: ...`.

A config is input from whoever wrote the file, so the loader bounds it before building anything: at
most MAX_CONFIG_BYTES (64 KiB) of text, mappings and lists nested at most MAX_DEPTH deep, and no
anchors or aliases at all (`&name` / `*name`, and so no `<<: *name` merges). An alias is a pointer:
nine of them nested nine deep ("billion laughs", 700 bytes) expand to 9^9 values, and one that points
at its own parent never ends. pyep's configs are short; write repeated values out, or override them on
the command line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple, Union

import yaml

from .._input import parse_uint

Path = Tuple[Union[str, int], ...]


def dotted(path: Path) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<top level>"


@dataclass
class Problem:
    where: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.key}: {self.message}"


class ConfigError(ValueError):
    """One or more problems in a config, each naming file, line and key."""

    def __init__(self, problems: List[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class ConfigRefused(ConfigError):
    """Text refused for its size, its nesting or its anchors and aliases (see the module docstring),
    before it was parsed into values."""


class _Refused(yaml.composer.ComposerError):
    pass


@dataclass
class Locations:
    """Where each path of the tree was written: a line of the source file or an override."""
    source: str
    lines: Dict[Path, int] = field(default_factory=dict)
    overrides: Dict[Path, str] = field(default_factory=dict)

    def given(self, path: Path) -> bool:
        return path in self.lines or path in self.overrides

    def where(self, path: Path) -> str:
        # The nearest written ancestor: a default value is blamed on the section that omitted it.
        for n in range(len(path), -1, -1):
            sub = path[:n]
            if sub in self.overrides:
                return f"override {self.overrides[sub]!r}"
            if sub in self.lines:
                return f"{self.source}:{self.lines[sub]}"
        return self.source

    def problem(self, path: Path, message: str) -> Problem:
        return Problem(self.where(path), dotted(path), message)


# pyep's configs are a few KiB (64 nodes listed one per line: 3 KiB). PyYAML's pure-Python reader takes
# seconds per 100 KiB on a loaded machine, so the bound also bounds the time: about a second.
MAX_CONFIG_BYTES = 64 << 10
MAX_DEPTH = 32


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors, aliases and deep nesting while composing, before any value is
    built or any alias expanded; the error carries the line."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            what = f"alias *{event.anchor}" if isinstance(event, yaml.AliasEvent) else f"anchor &{event.anchor}"
            raise _Refused(
                None, None, f"{what}: anchors and aliases are not allowed in pyep configs (write the value out)",
                event.start_mark)
        if self._depth >= MAX_DEPTH:
            raise _Refused(None, None, f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_value(text: str, where: str) -> Any:
    """One YAML value (an override's right-hand side) with the same bounds as a config file."""
    tree, _ = parse_yaml(text, where)
    return tree


def _walk(loader: yaml.SafeLoader, node: yaml.Node, path: Path, locs: Locations,
          problems: List[Problem]) -> Any:
    locs.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)     # resolves `<<: {...}` merges (`<<: *alias` never gets here)
        out: Dict[Any, Any] = {}
        for knode, vnode in node.value:
            if not isinstance(knode, yaml.ScalarNode):
                problems.append(Problem(f"{locs.source}:{knode.start_mark.line + 1}", dotted(path),
                                        "mapping keys must be plain scalars"))
                continue
            key = _scalar(loader, knode)
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                problems.append(Problem(f"{locs.source}:{knode.start_mark.line + 1}", dotted(path),
                                        f"key {key!r} must be a string or an integer"))
                continue
            if key in out:
                first = locs.lines.get(path + (key,), "?")
                problems.append(Problem(f"{locs.source}:{knode.start_mark.line + 1}", dotted(path + (key,)),
                                        f"duplicate key (first given on line {first})"))
                continue
            locs.lines[path + (key,)] = knode.start_mark.line + 1
            out[key] = _walk(loader, vnode, path + (key,), locs, problems)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_walk(loader, item, path + (i,), locs, problems) for i, item in enumerate(node.value)]
    return _scalar(loader, node)


def _scalar(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    try:
        return loader.construct_object(node)
    except ValueError as exc:   # an int past int()'s digit limit, a date like 2001-13-45
        raise yaml.constructor.ConstructorError(None, None, f"{str(node.value)[:40]!r} cannot be read: {exc}",
                                                node.start_mark) from None


def parse_yaml(text: str, source: str) -> Tuple[Any, Locations]:
    """Parse YAML text; returns (tree, locations). Syntax errors raise ConfigError with the line."""
    locs = Locations(source)
    problems: List[Problem] = []
    if not isinstance(text, str):
        raise TypeError(f"{source}: config text must be a str, got {type(text).__name__}")
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigRefused([Problem(source, "<file>", f"{len(text)} characters: a config is at most "
                                                       f"{MAX_CONFIG_BYTES} bytes")])
    try:
        loader = _BoundedLoader(text)     # it checks every character here
    except yaml.reader.ReaderError as exc:
        raise ConfigError([Problem(source, "<yaml>", f"character {exc.position}: #x{exc.character:04x} is not "
                                                     "allowed in YAML")]) from None
    try:
        root = loader.get_single_node()
        tree = {} if root is None else _walk(loader, root, (), locs, problems)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        message = str(exc.problem or exc)
        if exc.context and exc.context_mark is not None and exc.context_mark is not mark:
            message += f" ({exc.context} on line {exc.context_mark.line + 1})"
        error = ConfigRefused if isinstance(exc, _Refused) else ConfigError
        raise error([Problem(where, "<yaml>", message)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(source, "<yaml>", str(exc))]) from None
    finally:
        loader.dispose()
    if problems:
        raise ConfigError(problems)
    return tree, locs


_SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_\-]*)((?:\[[0-9]+\])*)")
_MAX_INDEX_DIGITS = 6


def parse_override_path(text: str) -> Path:
    """`ep.ib.sl`, `nodes[1].host` or `nodes.1.host` -> path tuple."""
    path: List[Union[str, int]] = []
    for seg in text.split("."):
        index = parse_uint(seg, _MAX_INDEX_DIGITS)
        if index is not None and seg == seg.strip():
            path.append(index)
            continue
        m = _SEGMENT.fullmatch(seg)
        indices = [parse_uint(i, _MAX_INDEX_DIGITS) for i in re.findall(r"\[([0-9]+)\]", m.group(2))] if m else []
        if not m or None in indices:
            raise ValueError(f"bad override key {text!r}: segment {seg!r} is not a name or an index")
        path.append(m.group(1))
        path.extend(i for i in indices if i is not None)
    return tuple(path)


def apply_override(tree: Dict[str, Any], locs: Locations, text: str) -> None:
    """Merge one `key.sub=value` into the tree. The value is read as YAML, so `ep.hidden=4096` is an
    integer and `workload.args=[--iters, 5]` a list; the schema then checks its type."""
    if "=" not in text:
        raise ConfigError([Problem(f"override {text!r}", text, "expected KEY=VALUE, e.g. ep.timeout_us=5000000")])
    key, raw = text.split("=", 1)
    try:
        path = parse_override_path(key.strip())
    except ValueError as exc:
        raise ConfigError([Problem(f"override {text!r}", key, str(exc))]) from None
    try:
        value = load_value(raw, f"override {text!r}") if raw.strip() else ""
    except ConfigRefused:
        raise
    except ConfigError:
        value = raw     # not YAML (e.g. "a: b: c"): keep the literal text
    node: Any = tree
    for i, part in enumerate(path[:-1]):
        nxt = path[i + 1]
        if isinstance(node, dict):
            if not isinstance(node.get(part), (dict, list)):
                # An absent list may be started at index 0 (`nodes[0].gpus=4` on a file without nodes:
                # the schema's default is one node too).
                node[part] = ([{}] if nxt == 0 else []) if isinstance(nxt, int) else {}
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            raise ConfigError([Problem(f"override {text!r}", dotted(path[:i + 1]),
                                       "no such list element or section to override")])
    last = path[-1]
    if isinstance(node, dict) and not isinstance(last, int):
        node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        node[last] = value
    else:
        raise ConfigError([Problem(f"override {text!r}", dotted(path), "no such list element or key to override")])
    # Everything at or below the path now comes from this override.
    for p in [p for p in list(locs.lines) if p[:len(path)] == path]:
        del locs.lines[p]
    for p in [p for p in list(locs.overrides) if p[:len(path)] == path]:
        del locs.overrides[p]
    _mark_override(path, value, locs, text)


def _mark_override(path: Path, value: Any, locs: Locations, text: str) -> None:
    locs.overrides[path] = text
    if isinstance(value, dict):
        for k, v in value.items():
            _mark_override(path + (k,), v, locs, text)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _mark_override(path + (i,), v, locs, text)
