"""Builds a CPU simulation module of tests/ll_sim (ll_sim.cpp, relay_sim.cpp): the kernel sources
compiled as host C++ with g++ against cuda_shim.h, cached by a hash of every source it depends on."""
from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from typing import Any, Iterator, List, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIM_DIR = os.path.join(ROOT, "tests", "ll_sim")


def build_module(name: str, patterns: list) -> str:
    """Compiles tests/ll_sim/<name>.cpp (cached by the hash of the files `patterns` match, relative to
    the repository root); returns the module path. Skips the test without g++ or pybind11."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to build the CPU simulation of the kernels")
    pybind11 = pytest.importorskip("pybind11")
    h = hashlib.sha256()
    files = {f for p in patterns for f in glob.glob(os.path.join(ROOT, p))} | {os.path.abspath(__file__)}
    for f in sorted(files):
        with open(f, "rb") as fh:
            h.update(f.encode() + fh.read())
    out_dir = os.path.join(tempfile.gettempdir(), f"pyep_{name}_{h.hexdigest()[:16]}")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    path = os.path.join(out_dir, name + suffix)
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    tmp = path + f".{os.getpid()}.tmp"
    cmd = ["g++", "-std=c++20", "-O1", "-g0", "-shared", "-fPIC", "-pthread", "-ffp-contract=off",
           "-DPYEP_LL_THREADS=64", "-I", os.path.join(ROOT, "engine"), "-I", SIM_DIR, "-I", pybind11.get_include(),
           "-I", sysconfig.get_paths()["include"], os.path.join(SIM_DIR, name + ".cpp"), "-o", tmp]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise AssertionError(f"building the kernel simulation {name} failed:\n{res.stderr[-4000:]}")
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def sim_worker(name: str, patterns: List[str]) -> Iterator[Tuple[Any, str]]:
    """(a one-process DistPool, the module path of build_module(name, patterns)): the simulated ranks
    run as threads of that one worker, so a wedged simulation never takes the pytest process with it."""
    from multiproc import DistPool
    path = build_module(name, patterns)
    with DistPool(1, start_timeout_s=120.0) as pool:
        yield pool, path

