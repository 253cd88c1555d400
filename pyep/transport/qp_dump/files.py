"""Dump documents on disk: writing one where nobody else can redirect it, finding a job's dumps, and
loading them back with every field checked (a dump file is input: `pyep qp dump` reads whatever sits
in a run directory).

Writing: the dump directory is usually shared (the run directory), and the rank's file name is easy
to guess, so the document goes into a fresh private directory beside the target (mkdtemp: mode 0700,
an unguessable name), into a file created with O_EXCL | O_NOFOLLOW, and is then renamed over the
target; a rename replaces a symlink planted at the target instead of following it, and readers never
see half a file.

Loading: at most MAX_DUMP_BYTES of UTF-8 JSON from a regular file, then the fields `pyep qp dump`
reads are checked against SCHEMA; anything else raises DumpRejected naming the file and the field.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Dict, List, Mapping, Sequence, Tuple

from ..._input import FileRejected, parse_uint, read_text

FORMAT = "pyep-qp-dump/1"
PREFIX = "qp_dump-rank"
# A QP is about 1.5 KiB of indented JSON: 64 MiB holds tens of thousands of them.
MAX_DUMP_BYTES = 64 << 20
_MAX_TIME = 1e11          # seconds since the epoch (year 5138): time.localtime() takes it
_MAX_INT = (1 << 64) - 1  # every integer field is a counter, an index or a QP number


class DumpRejected(ValueError):
    """A dump file that cannot be read as a pyep QP dump; the message names the file and the field."""


# field -> (kind, required). A kind is int, float (a number), str, bool, a nested schema (a dict), a
# one-element list (a list of that kind), or a tuple of kinds (any of them; None allows null).
Schema = Dict[str, Tuple[Any, bool]]
ERROR_SCHEMA: Schema = {"kind_name": (str, True), "syndrome_name": (str, False)}
# The rest of an error that names a syndrome (an error CQE): text.render_document prints them all.
CQE_ERROR_SCHEMA: Schema = {"syndrome": (int, True), "vendor_syndrome": (int, True), "wqe_counter": (int, True),
                            "cqe_opcode_name": (str, True), "wqe_opcode_name": (str, True), "hint": (str, True)}
LAST_CQE_SCHEMA: Schema = {"index": (int, True), "consumed": (bool, True), "opcode_name": (str, True),
                           "syndrome_name": (str, True), "wqe_counter": (int, True), "wqe_opcode_name": (str, True),
                           "error_cqes_in_ring": (int, True)}
PROVIDER_SCHEMA: Schema = {"kind": (str, False), "state": (str, False), "last_error": (str, False)}
QP_SCHEMA: Schema = {
    "peer": (int, True), "index": (int, True), "qpn": (int, True), "state": (str, True), "sq_size": (int, False),
    "resv": (int, True), "ready": (int, True), "cons": (int, True), "outstanding": (int, True),
    "reserved_unrung": (int, False), "cq_ci": (int, True), "wqes_posted": (int, True), "bytes_posted": (int, True),
    "error": ((ERROR_SCHEMA, None), False), "last_error_cqe": ((LAST_CQE_SCHEMA, None), False),
    "provider": (PROVIDER_SCHEMA, False),
}
PEER_SCHEMA: Schema = {"peer": (int, True), "qps": (int, True), "qps_in_error": (int, True),
                       "outstanding": (int, True), "wqes_posted": (int, True), "bytes_posted": (int, True)}
SCHEMA: Schema = {"format": (str, True), "rank": (int, True), "host": (str, False), "pid": (int, False),
                  "time": (float, False), "reason": (str, False), "error": ((str, None), False),
                  "qps": ([QP_SCHEMA], False), "peers": ([PEER_SCHEMA], False)}


def _name(kind: Any) -> str:
    if isinstance(kind, tuple):
        return " or ".join(_name(k) for k in kind)
    if isinstance(kind, dict):
        return "an object"
    if isinstance(kind, list):
        return "a list"
    return {int: "an integer", float: "a number", str: "a string of printable characters", bool: "true or false",
            None: "null"}[kind]


def _matches(value: Any, kind: Any) -> bool:
    if kind is None:
        return value is None
    if kind is int:
        return type(value) is int and 0 <= value <= _MAX_INT
    if kind is float:
        return type(value) in (int, float) and math.isfinite(value) and 0 <= value <= _MAX_TIME
    if kind is dict or isinstance(kind, dict):
        return isinstance(value, dict)
    if isinstance(kind, list):
        return isinstance(value, list)
    if kind is str:     # printed on a terminal: no escape sequences (an error message may span lines)
        return type(value) is str and all(ch.isprintable() or ch in "\n\t" for ch in value)
    return type(value) is kind


def _check(value: Any, kind: Any, where: str) -> None:
    """Raises ValueError naming `where` (a dotted field path) unless `value` is of `kind`."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    match = next((k for k in kinds if _matches(value, k)), False)
    if match is False:
        shown = repr(value) if isinstance(value, (int, float, bool, type(None))) else type(value).__name__
        raise ValueError(f"field {where}: expected {_name(kind)}, got {shown[:40]}")
    if isinstance(match, list):
        for i, item in enumerate(value):
            _check(item, match[0], f"{where}[{i}]")
    elif isinstance(match, dict):
        _check_fields(value, match, where)


def _check_fields(obj: Mapping[str, Any], schema: Schema, where: str) -> None:
    for name, (kind, required) in schema.items():
        sub = f"{where}.{name}" if where else name
        if name not in obj:
            if required:
                raise ValueError(f"field {sub} is missing")
            continue
        _check(obj[name], kind, sub)
    if schema is ERROR_SCHEMA and obj.get("syndrome_name"):
        _check_fields(obj, CQE_ERROR_SCHEMA, where)
    if schema is PROVIDER_SCHEMA and obj.get("last_error") and "kind" not in obj:
        raise ValueError(f"field {where}.kind is missing (needed with last_error)")


def validate_document(doc: Any, path: str = "<dump>") -> Dict[str, Any]:
    """`doc` if it is a pyep QP dump whose fields hold what `pyep qp dump` reads; DumpRejected naming
    `path` and the field otherwise."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DumpRejected(f"{path} is not a pyep QP dump (format {FORMAT})")
    try:
        _check_fields(doc, SCHEMA, "")
    except ValueError as exc:
        raise DumpRejected(f"{path}: {exc}") from None
    return doc


def write_document(doc: Mapping[str, Any], path: str) -> str:
    """Writes `doc` as JSON to `path` as the module docstring says; returns `path`."""
    private = tempfile.mkdtemp(prefix=".qp_dump-", dir=os.path.dirname(os.path.abspath(path)))
    tmp = os.path.join(private, "doc.json")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.rmdir(private)
    return path


def _rank_of(name: str) -> int:
    # qp_dump-rank12-buf0.json -> 12; an unnumbered name sorts first.
    num = parse_uint(name[len(PREFIX):].split("-")[0].split(".")[0], 9)
    return -1 if num is None else num


def dump_paths(out_dir: str) -> List[str]:
    """The dump files in a directory, in rank order."""
    names = [n for n in os.listdir(out_dir) if n.startswith(PREFIX) and n.endswith(".json")]
    return [os.path.join(out_dir, n) for n in sorted(names, key=lambda n: (_rank_of(n), n))]


def load_document(path: str) -> Dict[str, Any]:
    """One dump file, checked (see the module docstring); DumpRejected otherwise."""
    try:
        text = read_text(path, MAX_DUMP_BYTES)
    except FileRejected as exc:
        raise DumpRejected(str(exc)) from None
    try:
        doc = json.loads(text)
    except RecursionError:
        raise DumpRejected(f"{path} is not a pyep QP dump: JSON nested too deeply") from None
    except ValueError as exc:        # JSONDecodeError, and integers past int()'s digit limit
        raise DumpRejected(f"{path} is not JSON: {exc}") from None
    return validate_document(doc, path)


def load_documents(paths: Sequence[str]) -> List[Dict[str, Any]]:
    """The dumps in `paths` (files, or directories holding qp_dump-rank*.json); DumpRejected naming a
    path that is missing, holds no dumps or is not a dump."""
    files: List[str] = []
    for p in paths:
        if os.path.isdir(p):
            try:
                found = dump_paths(p)
            except OSError as exc:
                raise DumpRejected(f"{p}: {exc.strerror}") from None
            if not found:
                raise DumpRejected(f"{p} holds no {PREFIX}*.json files")
            files.extend(found)
        else:
            files.append(p)
    return [load_document(f) for f in files]
