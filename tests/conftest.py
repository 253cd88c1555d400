"""Shared pytest setup: the repository and tests/ on sys.path (so an uninstalled checkout works and
spawned workers can import test modules), and session-wide multi-process gloo pools."""
from __future__ import annotations

import os
import sys
from typing import Dict, Iterator, List, Tuple

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _p in (_ROOT, _TESTS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from multiproc import DistPool  # noqa: E402


# Session scope: starting workers (spawn + importing torch) costs seconds on a 2-core runner, so
# every module shares them. A test that breaks a pool (timeout, dead rank) makes it restart lazily.
@pytest.fixture(scope="session")
def pool2() -> Iterator[DistPool]:
    """Two gloo ranks on 127.0.0.1."""
    with DistPool(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4() -> Iterator[DistPool]:
    """Four gloo ranks on 127.0.0.1."""
    with DistPool(4) as pool:
        yield pool


@pytest.fixture(scope="module")
def pools() -> Iterator[Dict[int, DistPool]]:
    """GPU test modules: {world size: pool}, each started on first use, closed with the module (the ranks
    bind GPUs, so a module's pools do not outlive it). Generous start-up bound: workers import torch
    with CUDA."""
    from multiproc import LazyPools
    made = LazyPools(start_timeout_s=180.0, pg_timeout_s=300.0)
    yield made
    made.close()


def _kernel_sim(name: str, sources: List[str]) -> Iterator[Tuple[DistPool, str]]:
    """tests/ll_sim/<name>.cpp built (cached by the hash of its sources) and a worker to run it in."""
    sys.path.insert(0, os.path.join(_TESTS, "ll_sim"))
    from build import sim_worker
    with sim_worker(name, ["tests/ll_sim/*.h", f"tests/ll_sim/{name}.cpp", *sources]) as worker:
        yield worker


_NORMAL_KERNELS = ["engine/kernels/normal_*", "engine/kernels/ll_common.cuh", "engine/kernels/ll_launch.h",
                   "engine/mlx5gda/*.h"]


@pytest.fixture(scope="module")
def ll_sim_pool() -> Iterator[Tuple[DistPool, str]]:
    """The CPU simulation of the low-latency kernels (tests/test_ll_sim*.py)."""
    yield from _kernel_sim("ll_sim", ["engine/kernels/ll_*", "engine/mlx5gda/*.h"])


@pytest.fixture(scope="module")
def relay_sim_pool() -> Iterator[Tuple[DistPool, str]]:
    """The CPU simulation of the normal mode's RDMA relay (tests/test_relay_sim.py)."""
    yield from _kernel_sim("relay_sim", _NORMAL_KERNELS)


@pytest.fixture(scope="module")
def normal_sim_pool() -> Iterator[Tuple[DistPool, str]]:
    """The CPU simulation of the normal mode's intranode kernels (tests/test_normal_sim.py)."""
    yield from _kernel_sim("normal_sim", _NORMAL_KERNELS)


def _write_host_fixtures() -> None:
    # git keeps no empty directories, and a saved sysfs tree is full of them (an empty
    # /sys/class/infiniband is the point of the no-RDMA host): rebuild the trees before any test reads
    # them. The content is deterministic, so a clean checkout stays clean.
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location(
        "pyep_test_make_hosts", os.path.join(os.path.dirname(__file__), "fixtures", "make_hosts.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write_all()


_write_host_fixtures()
