"""Builds tests/oracle/mlx5_oracle.c against rdma-core's mlx5dv.h and loads it with ctypes.

Skips (with the reason) only when the header or a C compiler is missing; a compile error fails the
test, since it means the oracle or the header changed under us.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import pytest

HEADER = Path("/usr/include/infiniband/mlx5dv.h")
SOURCE = Path(__file__).with_name("mlx5_oracle.c")


def _u(n: int) -> type:
    return {8: ctypes.c_uint8, 16: ctypes.c_uint16, 32: ctypes.c_uint32, 64: ctypes.c_uint64}[n]


_SIGNATURES: Dict[str, tuple] = {
    "oracle_ctrl_seg": (None, [ctypes.c_void_p, _u(16), _u(8), _u(8), _u(32), _u(8), _u(8), _u(8), _u(32)]),
    "oracle_data_seg": (None, [ctypes.c_void_p, _u(32), _u(32), _u(64)]),
    "oracle_raddr_seg": (None, [ctypes.c_void_p, _u(64), _u(32)]),
    "oracle_atomic_seg": (None, [ctypes.c_void_p, _u(64), _u(64)]),
    "oracle_masked_fa32_seg": (None, [ctypes.c_void_p, _u(32), _u(32)]),
    "oracle_cqe": (None, [ctypes.c_void_p, _u(8), _u(8), _u(16), _u(32), _u(8), _u(32)]),
    "oracle_err_cqe": (None, [ctypes.c_void_p, _u(8), _u(8), _u(16), _u(32), _u(8), _u(8), _u(8)]),
    "oracle_cqe_opcode": (_u(8), [ctypes.c_char_p]),
    "oracle_cqe_owner": (_u(8), [ctypes.c_char_p]),
    "oracle_constant": (_u(32), [ctypes.c_char_p]),
}


@dataclass(frozen=True)
class Mlx5Oracle:
    lib: ctypes.CDLL

    def _call(self, name: str, nbytes: int, *args: int) -> bytes:
        buf = ctypes.create_string_buffer(nbytes)
        getattr(self.lib, name)(buf, *args)
        return buf.raw

    def ctrl_seg(self, pi: int, opcode: int, opmod: int, qpn: int, fm_ce_se: int, ds: int) -> bytes:
        return self._call("oracle_ctrl_seg", 16, pi, opcode, opmod, qpn, fm_ce_se, ds, 0, 0)

    def data_seg(self, length: int, lkey: int, addr: int) -> bytes:
        return self._call("oracle_data_seg", 16, length, lkey, addr)

    def raddr_seg(self, raddr: int, rkey: int) -> bytes:
        return self._call("oracle_raddr_seg", 16, raddr, rkey)

    def atomic_seg(self, swap_add: int, compare: int) -> bytes:
        return self._call("oracle_atomic_seg", 16, swap_add, compare)

    def masked_fa32_seg(self, add: int, field_boundary: int) -> bytes:
        return self._call("oracle_masked_fa32_seg", 16, add, field_boundary)

    def cqe(self, opcode: int, owner: int, wqe_counter: int, qpn: int, wqe_opcode: int, byte_cnt: int) -> bytes:
        return self._call("oracle_cqe", 64, opcode, owner, wqe_counter, qpn, wqe_opcode, byte_cnt)

    def err_cqe(self, opcode: int, owner: int, wqe_counter: int, qpn: int, wqe_opcode: int, syndrome: int,
                vendor_syndrome: int) -> bytes:
        return self._call("oracle_err_cqe", 64, opcode, owner, wqe_counter, qpn, wqe_opcode, syndrome,
                          vendor_syndrome)

    def cqe_opcode(self, cqe: bytes) -> int:
        return int(self.lib.oracle_cqe_opcode(cqe))

    def cqe_owner(self, cqe: bytes) -> int:
        return int(self.lib.oracle_cqe_owner(cqe))

    def constant(self, name: str) -> int:
        value = int(self.lib.oracle_constant(name.encode()))
        if value == 0xFFFFFFFF:
            raise KeyError(f"oracle has no constant {name}")
        return value


def build_oracle(tmpdir: Path) -> Mlx5Oracle:
    if not HEADER.exists():
        pytest.skip(f"{HEADER} not found: install rdma-core's headers (Debian/Ubuntu: libibverbs-dev)")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler (cc/gcc/clang) to build the rdma-core oracle")
    lib_path = tmpdir / "libmlx5_oracle.so"
    proc = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-o", str(lib_path), str(SOURCE)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"building the rdma-core oracle failed ({cc}):\n{proc.stderr}")
    lib = ctypes.CDLL(str(lib_path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return Mlx5Oracle(lib)
