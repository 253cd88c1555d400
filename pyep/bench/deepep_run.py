"""DeepEP V1's own figures in the same run as ours: tools/deepep_baseline.py (beside the package in a
checkout) runs DeepEP's test on this machine -- on DeepEP itself, or on pyep's DeepEP shim through the
same unchanged test file -- with its ranks sharing the GPUs the way the bench's did when there are
more ranks than GPUs (.anchors/deepep_v1.sh: gloo, rank % GPUs, the MPS daemon). Missing DeepEP is a
note, never an error: the tables go on without it."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any, Dict, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINE_TOOL = os.path.join(ROOT, "tools", "deepep_baseline.py")
ON = ("deepep", "pyep")      # whose library runs DeepEP's test (deepep_v1.sh's DEEPEP_ON)


def load_baseline_tool() -> Any:
    """tools/deepep_baseline.py as a module (it lives beside the package in a checkout)."""
    if not os.path.isfile(BASELINE_TOOL):
        raise FileNotFoundError(f"{BASELINE_TOOL} is missing: --deepep needs a pyep checkout")
    spec = importlib.util.spec_from_file_location("pyep_deepep_baseline", BASELINE_TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def deepep_figures(mode: str, num_ranks: int, extra: Sequence[str], out_dir: str,
                   json_path: Optional[str] = None, on: str = "deepep",
                   b2b_sms: Optional[int] = None) -> Tuple[Optional[Dict[str, Any]], str]:
    """(document, note). Loads json_path when given, else runs DeepEP's test now, on DeepEP (`on`
    "deepep") or on pyep's shim ("pyep") -- or, with b2b_sms (intranode only), DeepEP's bench() loop at
    that SM count (tools/deepep_baseline.py run_b2b), where its test's 24 SMs per rank do not fit. Never
    raises for a missing DeepEP: the note says what happened."""
    if on not in ON:
        raise ValueError(f"on must be one of {ON}, got {on!r}")
    who = "DeepEP" if on == "deepep" else "pyep's shim under DeepEP's test"
    try:
        if json_path:
            with open(json_path, encoding="utf-8") as fh:
                doc = json.load(fh)
            if not isinstance(doc, dict):
                raise ValueError(f"{json_path} holds no JSON object")
            return doc, f"{who}: figures from {json_path}"
        tool = load_baseline_tool()
        if b2b_sms:
            who = "DeepEP" if on == "deepep" else "pyep's shim in DeepEP's bench() loop"
            doc = tool.run_b2b(num_ranks, b2b_sms, list(extra), os.path.join(out_dir, f"deepep-b2b-on-{on}"), on=on)
            tool.write(os.path.join(out_dir, f"deepep_{mode}_b2b_on_{on}.json"), doc)
        else:
            doc = tool.run(mode, num_ranks, list(extra), os.path.join(out_dir, f"deepep-on-{on}"), on=on)
            tool.write(os.path.join(out_dir, f"deepep_{mode}_on_{on}.json"), doc)
    except (OSError, ValueError) as exc:
        return None, f"{who}: figures unavailable: {exc}"
    except Exception as exc:  # noqa: BLE001 - DeepEpUnavailable and friends: a note, not a crash
        return None, f"{who}: figures unavailable: {type(exc).__name__}: {exc}"
    if not doc.get("ok"):
        return doc, (f"{who} ran (rc={doc.get('rc')}) but printed no complete figures; see "
                     f"{doc.get('log') or 'its output'}")
    mps = " (deepep_v1.sh started the MPS daemon for it)" if doc.get("mps_started") else ""
    return doc, f"{who}: {mode} measured in this run ({doc.get('seconds', '?')} s, log {doc.get('log')}){mps}"


DEEPEP_TEST_SMS = 24     # tests/test_intranode.py's num_sms (hard-coded in its test_loop)


def deepep_b2b_sms(sharing: Any, swept: Sequence[int]) -> Optional[int]:
    """None when DeepEP's test (24 SMs per rank) fits the ranks on their GPU; else the largest SM count of
    the sweep that fits them (every block of every rank resident), at which DeepEP's bench() loop then
    runs on both libraries; None when none fits."""
    from .sharing import sm_fit
    per = sharing.ranks_per_device
    if not sharing.cuda or not sm_fit(DEEPEP_TEST_SMS, per, sharing.sms):
        return None
    fits = [n for n in swept if not sm_fit(n, per, sharing.sms)]
    return max(fits) if fits else None
