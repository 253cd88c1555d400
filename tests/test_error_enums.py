"""The Python decoders name every code of the kernels' error enums, read from the headers themselves:
pyep/ep/normal/errors.py against NormalError (engine/kernels/normal_launch.h), pyep/ep/ll/errors.py
against LLErrorCode and LLCallCode (engine/kernels/ll_launch.h). The simulation's check
(test_normal_sim.py, error_codes) compares through a list the simulation writes by hand, which a code
added to the header alone would pass. The parse is also checked against a header that gained a code, so
the test can fail."""
from __future__ import annotations

from typing import Dict

import pytest

from header_enums import enum_codes, header_text
from pyep.ep.ll import errors as ll_errors
from pyep.ep.normal import errors


def python_codes(module=errors, prefix: str = "ERR_") -> Dict[str, int]:
    return {k: v for k, v in vars(module).items() if k.startswith(prefix) and isinstance(v, int)
            and not k.endswith("_WORDS")}


def test_errors_py_names_every_normal_error_code() -> None:
    header = enum_codes(header_text("normal_launch.h"), "NormalError")
    assert header["ERR_NONE"] == 0 and len(header) >= 12
    assert header == python_codes()


def test_a_code_added_to_the_header_alone_is_seen() -> None:
    text = header_text("normal_launch.h")
    grown = text.replace("kErrLostPath = 12,", "kErrLostPath = 12,\n    kErrSomethingNew = 13,   // a = ...", 1)
    assert grown != text
    codes = enum_codes(grown, "NormalError")
    assert codes["ERR_SOMETHING_NEW"] == 13
    assert codes != python_codes()


@pytest.mark.parametrize("enum, prefix", [("LLErrorCode", "ERR_"), ("LLCallCode", "CALL_")])
def test_ll_errors_py_names_every_code(enum: str, prefix: str) -> None:
    header = enum_codes(header_text("ll_launch.h"), enum)
    assert header[prefix + "NONE"] == 0 and len(header) >= 3
    assert header == python_codes(ll_errors, prefix)
