"""The softnic's CUDA setting (pyep/softnic/cuda_env.py): set for ranks that use the softnic unless the
caller chose one, and a warning when a process's value can put softnic work behind a spinning kernel."""
from __future__ import annotations

from pyep.softnic.cuda_env import RECOMMENDED, VARIABLE, cuda_connections_warning, softnic_cuda_env


def test_set_unless_chosen() -> None:
    env: dict = {}
    softnic_cuda_env(env)
    assert env[VARIABLE] == str(RECOMMENDED)
    env = {VARIABLE: "4"}
    softnic_cuda_env(env)
    assert env[VARIABLE] == "4"


def test_processes_sharing_a_gpu_split_the_queues() -> None:
    from pyep.softnic.cuda_env import CUDA_DEFAULT, connections_for
    assert connections_for(1) == connections_for(3) == RECOMMENDED
    assert connections_for(4) == 24 and connections_for(8) == 12
    assert connections_for(16) == CUDA_DEFAULT == connections_for(100)
    env: dict = {}
    softnic_cuda_env(env, processes_on_gpu=16)
    assert env[VARIABLE] == str(CUDA_DEFAULT)


def test_warning_names_the_variable_and_the_fix() -> None:
    for value in (None, "1", "8", "x"):
        env = {} if value is None else {VARIABLE: value}
        why = cuda_connections_warning(env)
        assert why is not None and VARIABLE in why and f"{VARIABLE}={RECOMMENDED}" in why
    assert cuda_connections_warning({VARIABLE: str(RECOMMENDED)}) is None
    assert cuda_connections_warning({VARIABLE: "16"}) is None and cuda_connections_warning({VARIABLE: "64"}) is None


def test_drill_ranks_on_the_softnic_get_it(monkeypatch) -> None:
    import subprocess

    import pyep.launch.drill as drill
    seen = {}

    def fake_popen(argv, env, **kw):   # noqa: ANN001
        seen.update(env)
        raise RuntimeError("not started")

    monkeypatch.delenv(VARIABLE, raising=False)
    monkeypatch.setattr(subprocess, "Popen", fake_popen)
    for transport, expect in (("emulated", str(RECOMMENDED)), ("nvlink", None)):
        seen.clear()
        try:
            drill._spawn({"backend": "native", "transport": transport, "world": 2}, "/nonexistent/secret")
        except RuntimeError:
            pass
        assert seen.get(VARIABLE) == expect


def test_launch_gives_softnic_ranks_the_setting() -> None:
    import pathlib

    from pyep.config import parse_config
    from pyep.launch.plan import node_env
    path = pathlib.Path(__file__).resolve().parent.parent / "configs" / "two_virtual_nodes.yaml"
    cfg, _ = parse_config(path.read_text(), str(path))
    assert str(cfg.ep.transport).startswith("emulated")
    assert node_env(cfg, 0, "/tmp/run", True, parent_env={})[VARIABLE] == str(RECOMMENDED)
    assert VARIABLE not in node_env(cfg, 0, "/tmp/run", True, parent_env={VARIABLE: "8"})
