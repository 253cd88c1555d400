"""Elastic membership on GPUs (issue 12; marked gpu, skipped without CUDA or the CUDA build of
pyep._engine). Runs `pyep drill` (pyep.launch.drill.run_drill) with the native backend: ranks of a
store-based EpBuffer (they may share one GPU), one SIGKILLed in the middle of dispatch, of combine and
between calls, restarted, re-admitted, then 1000 calls bit-equal to the reference definition on every
rank; the survivors finish the call that finds it dead within a healthy call + timeout + 50 ms and keep
their per-call time. Each test is 20 drills over one transport (NVLink, the softnic "emulated").

In every drill each survivor also snapshots its links to the other peers (QP numbers, state and the
softnic's per-QP counters: WQEs, bytes, doorbells, consumer index; NVLink addresses) around every
admit_pending() that does rejoin work, and the drill fails if a rejoin changed any of them."""
from __future__ import annotations

import logging
import os
from typing import Any, Dict

import pytest
from multiproc import usable_gpus

pytestmark = pytest.mark.gpu
log = logging.getLogger("tests.elastic_gpu")
NGPU = usable_gpus("ep")
requires_gpu = pytest.mark.skipif(NGPU == 0, reason="needs a CUDA GPU and the CUDA build of pyep._engine")
DRILLS = int(os.environ.get("PYEP_ELASTIC_DRILLS", "20"))
ROUNDS = int(os.environ.get("PYEP_ELASTIC_ROUNDS", "1000"))


def _cfg(transport: str, **kw: Any) -> Any:
    from pyep.launch.drill import DrillConfig
    world = max(2, min(4, 2 * NGPU)) if NGPU else 2
    a: Dict[str, Any] = dict(backend="native", transport=transport,
                             world=int(os.environ.get("PYEP_ELASTIC_WORLD", world)), drills=DRILLS,
                             phases=("dispatch", "combine", "between"), victim=-1, kill_call=24,
                             timeout_us=50_000 if transport == "nvlink" else 200_000, slack_ms=50.0,
                             max_slowdown=1.5, rounds_after=ROUNDS, lead_calls=8, tokens=32, hidden=1024,
                             experts=0, topk=4, seed=1, join_timeout_s=180.0, drill_timeout_s=600.0)
    a.update(kw)
    return DrillConfig(**a)   # experts 0: 4 per rank


@requires_gpu
@pytest.mark.parametrize("transport", ["nvlink", "emulated"])
def test_drills_kill_restart_rejoin(transport: str) -> None:
    from pyep.launch.drill import run_drill
    cfg = _cfg(transport)
    outs = []
    for i in range(cfg.drills):
        o = run_drill(cfg, i, cfg.phases[i % len(cfg.phases)])
        log.warning("drill %d %s %s: detect %.2f ms (device dispatch/combine %s), rejoin %.2f s, %.3f ms/call "
                    "before, %.3f after (newcomer %.3f; device %s -> %s; iteration %.3f -> %.3f, newcomer %.3f) %s",
                    i, o.phase, "PASS" if o.ok else "FAIL", o.detect_ms, o.death_split_ms, o.rejoin_s, o.healthy_ms,
                    o.after_ms, o.newcomer_ms, o.split_before_ms, o.split_after_ms, o.loop_before_ms,
                    o.loop_after_ms, o.newcomer_loop_ms, o.why)
        outs.append(o)
    failed = [(o.index, o.phase, o.why) for o in outs if not o.ok]
    assert not failed, f"{len(failed)}/{len(outs)} drills failed ({sum(o.hang for o in outs)} hangs): {failed}"
    assert all(o.rounds_checked == cfg.rounds_after + 1 for o in outs)
