"""`pyep drill --mode normal` (issue 26; docs/elastic.md, "Normal mode"): the drill on the reference
backend with real SIGKILLs, its option checks and its command line. The native kernels' drill runs on a
GPU (tools/onegpu_acceptance.sh drills-normal)."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("phase", ["layout", "dispatch", "combine", "between"])
def test_normal_drill_kill_restart_rejoin(phase: str) -> None:
    """`pyep drill --mode normal` on the reference backend: a real rank process is SIGKILLed in the
    layout exchange, in dispatch, in combine (mid-exchange: some of its mail is out) or between steps;
    the survivor marks it, its steps stay bit-equal to the definition for the surviving ranks (the
    victim's tokens dropped and counted), the restarted process (generation 2) is admitted, and every
    step after is the full definition on every rank. No timing is asserted."""
    from pyep.launch.drill import DrillConfig, run_drill
    # 3 ranks: the victim's last message reaches rank 0 but not rank 1, so the survivors see the death
    # in different exchanges of the step (and their results of it differ by the victim's part).
    cfg = DrillConfig(mode="normal", backend="reference", transport="auto", world=3, drills=1, phases=(phase,),
                      kill_call=20, timeout_us=1_500_000, slack_ms=60_000.0, max_slowdown=1e6, rounds_after=5,
                      lead_calls=2, tokens=8, hidden=128, experts=6, topk=2, seed=7, join_timeout_s=120.0,
                      drill_timeout_s=300.0)
    out = run_drill(cfg, 0, phase)
    assert out.ok, out.why
    survivors = [r for r in out.ranks if r["generation"] == 1]
    newcomer = [r for r in out.ranks if r["generation"] == 2]
    assert len(survivors) == 2 and all(s["marked"] == [2] for s in survivors)
    assert all(s["death_call"] in (20, 21) and out.joined_at > s["death_call"] for s in survivors)
    assert len(newcomer) == 1 and newcomer[0]["calls_after_join"] == 6 and out.rounds_checked == 6
    assert all(r["final_active"] == [1, 1, 1] for r in out.ranks)


@pytest.mark.parametrize("world,per_node", [(3, 1), (4, 2)])
def test_normal_drill_on_virtual_nodes_reference(world: int, per_node: int) -> None:
    """The same drill on virtual nodes (--transport emulated, --ranks-per-node): the reference's node
    layout (num_tokens_per_rdma_rank, combine with a BF16 partial per node) through a kill in dispatch
    and a rejoin."""
    from pyep.launch.drill import DrillConfig, run_drill
    cfg = DrillConfig(mode="normal", backend="reference", transport="emulated", world=world, ranks_per_node=per_node,
                      drills=1, phases=("dispatch",), kill_call=20, timeout_us=1_500_000, slack_ms=60_000.0,
                      max_slowdown=1e6, rounds_after=5, lead_calls=2, tokens=8, hidden=128, experts=2 * world, topk=2,
                      seed=9, join_timeout_s=120.0, drill_timeout_s=300.0)
    assert cfg.normal_ranks_per_node == per_node
    out = run_drill(cfg, 0, "dispatch")
    assert out.ok, out.why
    survivors = [r for r in out.ranks if r["generation"] == 1]
    newcomer = [r for r in out.ranks if r["generation"] == 2]
    assert len(survivors) == world - 1 and all(s["marked"] == [world - 1] for s in survivors)
    assert len(newcomer) == 1 and newcomer[0]["calls_after_join"] == 6 and out.rounds_checked == 6
    assert all(r["final_active"] == [1] * world for r in out.ranks)


def test_drill_config_normal_mode_checks() -> None:
    from pyep.launch.drill import NORMAL_PHASES, PHASES, DrillConfig
    assert DrillConfig(mode="normal", backend="reference").phases == NORMAL_PHASES
    assert DrillConfig(backend="reference").phases == PHASES
    assert DrillConfig(mode="normal", backend="native").transport == "nvlink"
    assert DrillConfig(mode="normal", backend="native").normal_ranks_per_node is None
    # Over the softnic: one rank per virtual node (the internode path, its column relay on the softnic).
    assert DrillConfig(mode="normal", backend="native", transport="emulated").normal_ranks_per_node == 1
    assert DrillConfig(mode="normal", backend="reference", transport="emulated").normal_ranks_per_node == 1
    with pytest.raises(ValueError, match="--mode normal --backend native runs over --transport nvlink .one node. or "
                                         "emulated"):
        DrillConfig(mode="normal", backend="native", transport="ibgda")
    assert DrillConfig(mode="normal", transport="emulated", world=4, ranks_per_node=2).normal_ranks_per_node == 2
    with pytest.raises(ValueError, match="--ranks-per-node goes with --mode normal --transport emulated"):
        DrillConfig(mode="normal", transport="nvlink", world=4, ranks_per_node=2)
    for world, per_node in ((4, 3), (4, 4)):
        with pytest.raises(ValueError, match="must divide --world"):
            DrillConfig(mode="normal", transport="emulated", world=world, ranks_per_node=per_node)
    with pytest.raises(ValueError, match="--phases must name some of dispatch, combine, between"):
        DrillConfig(backend="reference", phases=("layout",))
    with pytest.raises(ValueError, match="--mode must be one of"):
        DrillConfig(mode="fast")


def test_cli_drill_mode_normal_arguments(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from hostile_util import run_cli
    rc, _, err = run_cli(["drill", "--mode", "normal", "--backend", "native", "--transport", "ibgda"],
                         monkeypatch, capsys)
    assert rc == 2 and "--mode normal --backend native runs over --transport nvlink (one node)" in err, err
    rc, _, err = run_cli(["drill", "--mode", "normal", "--backend", "reference", "--phases", ","], monkeypatch, capsys)
    assert rc == 2 and "layout, dispatch, combine, between (--mode normal)" in err, err
