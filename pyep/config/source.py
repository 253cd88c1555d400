"""YAML text -> plain Python tree, keeping where every key and value came from.

PyYAML's `compose` gives nodes with marks; we walk them ourselves (constructing only scalars) so that
each path in the tree ("ep", "num_experts") remembers its line. Command-line overrides are merged into
the same tree and remember the override text instead. Errors then read
`configs/x.yaml:12: ep.num_experts: ...`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple, Union

import yaml

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


def _walk(loader: yaml.SafeLoader, node: yaml.Node, path: Path, locs: Locations,
          problems: List[Problem]) -> Any:
    locs.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)     # resolves `<<: *anchor` merges
        out: Dict[Any, Any] = {}
        for knode, vnode in node.value:
            if not isinstance(knode, yaml.ScalarNode):
                problems.append(Problem(f"{locs.source}:{knode.start_mark.line + 1}", dotted(path),
                                        "mapping keys must be plain scalars"))
                continue
            key = loader.construct_object(knode)
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
    return loader.construct_object(node)


def parse_yaml(text: str, source: str) -> Tuple[Any, Locations]:
    """Parse YAML text; returns (tree, locations). Syntax errors raise ConfigError with the line."""
    locs = Locations(source)
    problems: List[Problem] = []
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        tree = {} if root is None else _walk(loader, root, (), locs, problems)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        message = str(exc.problem or exc)
        if exc.context and exc.context_mark is not None and exc.context_mark is not mark:
            message += f" ({exc.context} on line {exc.context_mark.line + 1})"
        raise ConfigError([Problem(where, "<yaml>", message)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(source, "<yaml>", str(exc))]) from None
    finally:
        loader.dispose()
    if problems:
        raise ConfigError(problems)
    return tree, locs


_SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_\-]*)((?:\[\d+\])*)")


def parse_override_path(text: str) -> Path:
    """`ep.ib.sl`, `nodes[1].host` or `nodes.1.host` -> path tuple."""
    path: List[Union[str, int]] = []
    for seg in text.split("."):
        if seg.isdigit():
            path.append(int(seg))
            continue
        m = _SEGMENT.fullmatch(seg)
        if not m:
            raise ValueError(f"bad override key {text!r}: segment {seg!r} is not a name or an index")
        path.append(m.group(1))
        path.extend(int(i) for i in re.findall(r"\[(\d+)\]", m.group(2)))
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
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
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
