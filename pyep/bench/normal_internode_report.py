"""The internode part of `pyep bench --mode normal`'s output (when the ranks form several (virtual)
nodes): for every measured row the RDMA and NVL GB/s per rank as DeepEP's tests/test_internode.py
counts them, labelled with what carried the rows between nodes, beside the real-NIC model's
expectation in the same count (normal_internode_model.py) and DeepEP's published internode figures.

What the measured figures are depends on the transport, and the label says so: on the softnic
("emulated") they time the emulator -- a host thread that executes the WQEs as cudaMemcpyAsync, and a
relay that waits for its stream after each launch (internode_relay.drain_after_launch) -- not a NIC;
on the reference backend they time torch.distributed collectives. Only "nic" rows measure a NIC.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Sequence

from .normal import NormalBenchConfig, NormalRow
from .normal_internode_model import model
from .reference_numbers import DEEPEP_INTERNODE_LABEL, DEEPEP_INTERNODE_RDMA_GBPS
from .tables import emit, table

TRANSPORT_LABELS = {
    "emulated": "emulated: the softnic between virtual nodes -- these figures measure the emulator, not a NIC",
    "nic": "NIC: IBGDA on the nodes' NICs",
    "reference": "reference backend: torch.distributed all-to-alls, no NIC -- these figures measure the collectives",
}
# (our phase, the model's stage), in the columns' order (FP8, BF16, combine: as the tables above).
SHOWN = (("cached_fp8", "dispatch_fp8"), ("cached_bf16", "dispatch_bf16"), ("combine", "combine"))
BYTE_MODEL = {
    "rdma": "sum of num_tokens_per_rdma_rank (every node a token reaches, its own included: test_internode.py's "
            "num_rdma_token_sent) x 2H; FP8 x (1 + 4/128) / 2; combine as BF16 dispatch",
    "nvl": "received rows x 2H; FP8 x (1 + 4/128) / 2; combine as BF16 dispatch",
    "gbps": "mean bytes per rank / (max over ranks of the mean time); kernel time = all the call's device work",
    "source": "DeepEP tests/test_internode.py (its \"RDMA\" and \"NVL\" GB/s lines)"}


def _kind(row: NormalRow) -> str:
    """The time the figures use: per-kernel (kineto) where it was measured, else the wall time."""
    measured = any(not math.isnan(row.time_us("kernel", p)) for p, _ in SHOWN)
    return "kernel" if measured and not row.kernel_source.startswith("wall") else "wall"


def summary(cfg: NormalBenchConfig, rows: Sequence[NormalRow], world_size: int, ranks_per_node: int,
            transports: Mapping[str, str]) -> Dict[str, Any]:
    """The JSON section "internode". transports: backend -> "emulated" / "nic" / "reference"."""
    nic = model(cfg.tokens, cfg.hidden, cfg.topk, cfg.experts, world_size, ranks_per_node)
    measured: List[Dict[str, Any]] = []
    for r in rows:
        if r.skipped or not r.stats or not r.rdma_tokens:
            continue
        kind = _kind(r)
        rdma, nvl = r.gbps(kind, rdma=True), r.gbps(kind)
        measured.append({
            "backend": r.backend, "num_sms": r.num_sms, "transport": transports.get(r.backend, "?"),
            "time_kind": kind, "rdma_tokens_per_rank": r.rdma_tokens,
            "phases": {p: {"us": r.time_us(kind, p), "rdma_gbps": rdma.get(p), "nvl_gbps": nvl.get(p)}
                       for p, _ in SHOWN}})
    expected = {p: {"us": nic[s]["staged_us"], "pipelined_us": nic[s]["pipelined_us"],
                    "rdma_gbps": nic[s]["deepep_rdma_gbps"], "nvl_gbps": nic[s]["deepep_nvl_gbps"]}
                for p, s in SHOWN}
    applies = cfg.routing.kind == "uniform" and cfg.drop_fraction == 0.0
    return {
        "num_nodes": world_size // ranks_per_node, "ranks_per_node": ranks_per_node,
        "transports": {b: {"kind": t, "label": TRANSPORT_LABELS[t]} for b, t in transports.items()},
        "byte_model": BYTE_MODEL, "rows": measured,
        "model_expectation": {"phases": expected, "nic_gbps": nic["nic_gbps"], "nvl_gbps": nic["nvl_gbps"],
                              "applies": applies,
                              "note": "staged (RDMA stage then NVLink stage, pyep's design); uniform routing"
                                      + ("" if applies else f"; this run used {cfg.routing.label}, drop "
                                                             f"{cfg.drop_fraction:g}: the model does not describe it")},
        "model": nic,
        "deepep_published": {"rdma_gbps": list(DEEPEP_INTERNODE_RDMA_GBPS), "label": DEEPEP_INTERNODE_LABEL}}


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def render(console: Any, doc: Dict[str, Any]) -> None:
    from rich.markup import escape
    exp = doc["model_expectation"]
    pub = doc["deepep_published"]["rdma_gbps"]
    t = table()
    for col in ("row", "SMs", "figures", "time"):
        t.add_column(col)
    for col in ("dispatch FP8 (cached)\nus / RDMA / NVL", "dispatch BF16 (cached)\nus / RDMA / NVL",
                "combine\nus / RDMA / NVL"):
        t.add_column(col, justify="right")
    for r in doc["rows"]:
        cells = [f"{_fmt(f['us'])} / {_fmt(f['rdma_gbps'])} / {_fmt(f['nvl_gbps'])}"
                 for f in (r["phases"][p] for p, _ in SHOWN)]
        t.add_row(r["backend"], str(r["num_sms"]), r["transport"], r["time_kind"], *cells)
    cells = [f"{_fmt(f['us'])} / {_fmt(f['rdma_gbps'])} / {_fmt(f['nvl_gbps'])}"
             for f in (exp["phases"][p] for p, _ in SHOWN)]
    t.add_row(f"[italic]model, {exp['nic_gbps']:g} GB/s NIC[/italic]", "-", "real NIC", "staged", *cells)
    band = f"{pub[0]:g}-{pub[1]:g}"
    t.add_row("[italic]DeepEP published[/italic]", "-", "real NIC", "-", f"- / {band} / -", f"- / {band} / -",
              f"- / {band} / -")
    emit(console, f"pyep bench --mode normal across {doc['num_nodes']} nodes x {doc['ranks_per_node']} ranks: "
                  f"us / RDMA GB/s / NVL GB/s per rank (DeepEP test_internode.py's byte count)", t,
         "RDMA bytes: node fan-out (own node included) x 2H; NVL bytes: received rows x 2H; FP8 x (1+4/128)/2. "
         "Model: expected on real NICs, not measured.")
    for backend, tr in doc["transports"].items():
        console.print(escape(f"figures of the {backend} backend -- {tr['label']}"))
    if not exp["applies"]:
        console.print(escape(f"model: {exp['note']}"))
    if not doc["rows"]:
        console.print("no internode row was measured (skipped, or the correctness guard failed)")


def attach(console: Any, doc: Dict[str, Any], cfg: NormalBenchConfig, rows: Sequence[NormalRow],
           world_size: int, ranks_per_node: int, transports: Mapping[str, str]) -> Dict[str, Any]:
    """Print the internode table and the model's table; add both to the JSON document."""
    from .normal_internode_model import render as render_model
    section = summary(cfg, rows, world_size, ranks_per_node, transports)
    render(console, section)
    render_model(console, section["model"])
    doc["internode"] = section
    doc["internode_model"] = section["model"]
    return section
