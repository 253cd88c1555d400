"""The Python decoders name every code of the kernels' error enums, read from the headers themselves:
pyep/ep/normal/errors.py against NormalError (engine/kernels/normal_launch.h), pyep/ep/ll/errors.py
against LLErrorCode and LLCallCode (engine/kernels/ll_launch.h). The simulation's check
(test_normal_sim.py, error_codes) compares through a list the simulation writes by hand, which a code
added to the header alone would pass. The parse is also checked against a header that gained a code, so
the test can fail."""
from __future__ import annotations

import os
import re
from typing import Dict

import pytest

from pyep.ep.ll import errors as ll_errors
from pyep.ep.normal import errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "engine", "kernels", "normal_launch.h")
LL_HEADER = os.path.join(ROOT, "engine", "kernels", "ll_launch.h")


def enum_codes(text: str, enum: str) -> Dict[str, int]:
    """{ERR_NAME: value} of `enum <enum> : int { kErrName = value, ... };` (every enumerator carries an
    explicit value; comments may follow any of them)."""
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


def python_codes(module=errors, prefix: str = "ERR_") -> Dict[str, int]:
    return {k: v for k, v in vars(module).items() if k.startswith(prefix) and isinstance(v, int)
            and not k.endswith("_WORDS")}


def test_errors_py_names_every_normal_error_code() -> None:
    with open(HEADER) as f:
        header = enum_codes(f.read(), "NormalError")
    assert header["ERR_NONE"] == 0 and len(header) >= 12
    assert header == python_codes()


def test_a_code_added_to_the_header_alone_is_seen() -> None:
    with open(HEADER) as f:
        text = f.read()
    grown = text.replace("kErrLostPath = 12,", "kErrLostPath = 12,\n    kErrSomethingNew = 13,   // a = ...", 1)
    assert grown != text
    codes = enum_codes(grown, "NormalError")
    assert codes["ERR_SOMETHING_NEW"] == 13
    assert codes != python_codes()


@pytest.mark.parametrize("enum, prefix", [("LLErrorCode", "ERR_"), ("LLCallCode", "CALL_")])
def test_ll_errors_py_names_every_code(enum: str, prefix: str) -> None:
    with open(LL_HEADER) as f:
        header = enum_codes(f.read(), enum)
    assert header[prefix + "NONE"] == 0 and len(header) >= 3
    assert header == python_codes(ll_errors, prefix)
