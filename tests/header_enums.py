"""The kernels' enums read from their C++ headers, for tests that check Python tables against them (the
Python side cannot include the headers, and a hand-kept copy would pass a code added to one side)."""
from __future__ import annotations

import os
import re
from typing import Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def header_text(name: str) -> str:
    """engine/kernels/<name>."""
    with open(os.path.join(ROOT, "engine", "kernels", name)) as f:
        return f.read()


def enum_codes(text: str, enum: str) -> Dict[str, int]:
    """{UPPER_SNAKE: value} of `enum <enum> : int { kCamelName = value, ... };` (kErrExpertId -> ERR_EXPERT_ID).
    Every enumerator must carry an explicit value; comments may follow any of them."""
    m = re.search(r"enum\s+%s\s*:\s*int\s*\{(.*?)\};" % re.escape(enum), text, re.S)
    assert m, f"no enum {enum}"
    body = re.sub(r"//[^\n]*", "", m.group(1))
    out: Dict[str, int] = {}
    for name, value in re.findall(r"\b(k[A-Za-z0-9]+)\s*=\s*(\d+)", body):
        words = re.findall(r"[A-Z][a-z0-9]*", name[1:])
        out["_".join(w.upper() for w in words)] = int(value)
    n_enumerators = len([e for e in body.split(",") if e.strip()])
    assert n_enumerators == len(out), f"an enumerator of {enum} without an explicit value: {body}"
    return out
