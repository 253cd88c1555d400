"""`pyep qp encode-wqe / decode-wqe / decode-cqe`: exact output, text and JSON, exit status 2 on bad input."""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
from pytest import CaptureFixture, MonkeyPatch

import pyep.cli as cli
from pyep.cli import qp as qp_cli

ROOT = Path(__file__).resolve().parents[1]

# Hand-checked: ctrl 00000508 (opmod 0, wqe_index 5, RDMA_WRITE) 00012303 (qpn 0x123, ds 3)
# 00000008 (CQ_UPDATE) 00000000 | raddr 0000000000002000 rkey 00000009 0 | data 00001000 (4096 B)
# lkey 00000007 laddr 0000000000001000 | 16 zero bytes.
WRITE_ARGS = ["--opcode", "rdma_write", "--wqe-index", "5", "--qpn", "0x123", "--signaled", "--laddr", "0x1000",
              "--lkey", "7", "--raddr", "0x2000", "--rkey", "9", "--length", "4096"]
WRITE_HEX = ("00000508" "00012303" "00000008" "00000000"
             "0000000000002000" "00000009" "00000000"
             "00001000" "00000007" "0000000000001000"
             + "00" * 16)


def run(argv: List[str], monkeypatch: MonkeyPatch, capsys: CaptureFixture[str],
        stdin: str = "") -> Tuple[int, str, str]:
    # Only `qp` is registered so these tests exercise this command alone, whatever else is in flux.
    monkeypatch.setattr(cli, "COMMANDS", {"qp": "pyep.cli.qp"})
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        rc = cli.main(["qp"] + argv)
    except SystemExit as exc:  # argparse's own errors
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_encode_hand_checked(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    rc, out, err = run(["encode-wqe"] + WRITE_ARGS, monkeypatch, capsys)
    assert (rc, out, err) == (0, WRITE_HEX + "\n", "")


def test_encode_each_opcode_round_trips_through_decode(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    cases = {
        "nop": ["--opcode", "nop", "--wqe-index", "0xffff", "--qpn", "16777215"],
        "masked_fa32": ["--opcode", "masked_fa32", "--wqe-index", "1", "--qpn", "2", "--laddr", "3", "--lkey", "4",
                        "--raddr", "5", "--rkey", "6", "--add", "0xffffffff", "--signaled"],
        "fa64": ["--opcode", "fa64", "--wqe-index", "1", "--qpn", "2", "--laddr", "3", "--lkey", "4",
                 "--raddr", "5", "--rkey", "6", "--add", "18446744073709551615", "--fence"],
    }
    expect = {"nop": ("NOP", 65535, 0xFFFFFF, 1), "masked_fa32": ("ATOMIC_MASKED_FA", 1, 2, 4),
              "fa64": ("ATOMIC_FA", 1, 2, 4)}
    for name, argv in cases.items():
        rc, out, _ = run(["encode-wqe"] + argv, monkeypatch, capsys)
        assert rc == 0 and len(out.strip()) == 128
        rc, js, _ = run(["decode-wqe", "--json", out.strip()], monkeypatch, capsys)
        d = json.loads(js)
        assert rc == 0 and (d["opcode_name"], d["wqe_index"], d["qpn"], d["ds"]) == expect[name]
        assert d["problems"] == []
    assert d["add"] == 2**64 - 1 and d["fence"] is True and d["signaled"] is False


def test_decode_wqe_text_and_json(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    rc, out, _ = run(["decode-wqe", WRITE_HEX], monkeypatch, capsys)
    assert rc == 0
    assert "WQE RDMA_WRITE (opcode 0x08, opmod 0x00), wqe_index 5, qpn 0x000123 (291), ds 3" in out
    assert "signaled, a CQE will be written" in out
    assert "raddr 0x0000000000002000, rkey 0x00000009" in out
    assert "4096 bytes at laddr 0x0000000000001000, lkey 0x00000007" in out
    assert "problem" not in out
    rc, out, _ = run(["decode-wqe", "--json"] + [WRITE_HEX[i:i + 8] for i in range(0, 128, 8)], monkeypatch, capsys)
    d = json.loads(out)
    assert rc == 0 and (d["raddr"], d["rkey"], d["laddr"], d["lkey"], d["length"]) == (0x2000, 9, 0x1000, 7, 4096)
    assert d["flags"] == ["CQ_UPDATE"] and d["signaled"] is True


def test_decode_wqe_reports_problems(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    bad = WRITE_HEX[:14] + "04" + WRITE_HEX[16:]  # ds 4 instead of 3
    rc, out, _ = run(["decode-wqe", bad], monkeypatch, capsys)
    assert rc == 0 and "problem: ds=4 but pyep's RDMA_WRITE WQE has 3 segments" in out


def test_decode_from_stdin(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    rc, out, _ = run(["decode-wqe", "--json", "-"], monkeypatch, capsys, stdin=WRITE_HEX + "\n")
    assert rc == 0 and json.loads(out)["length"] == 4096


def test_decode_cqe_text_and_json(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    # REQ_ERR, owner 1, REMOTE_ACCESS_ERR (0x13), vendor 0x88, failed WQE RDMA_WRITE #5 on qpn 0x123.
    raw = bytearray(64)
    raw[54], raw[55] = 0x88, 0x13
    raw[56:64] = bytes.fromhex("08000123" "0005" "00" "d1")
    rc, out, _ = run(["decode-cqe", raw.hex()], monkeypatch, capsys)
    assert rc == 0
    assert "CQE REQ_ERR (opcode 13)" in out and "owner 1" in out and "wqe_counter 5" in out
    assert "syndrome REMOTE_ACCESS_ERR (0x13): remote access error" in out and "vendor syndrome 0x88" in out
    rc, out, _ = run(["decode-cqe", "--json", raw.hex()], monkeypatch, capsys)
    d = json.loads(out)
    assert (d["opcode_name"], d["syndrome_name"], d["vendor_syndrome"], d["wqe_counter"], d["qpn"], d["owner"],
            d["wqe_opcode_name"]) == ("REQ_ERR", "REMOTE_ACCESS_ERR", 0x88, 5, 0x123, 1, "RDMA_WRITE")
    good = bytearray(64)
    good[44:48] = (4096).to_bytes(4, "big")
    good[56:64] = bytes.fromhex("08000123" "0006" "00" "00")
    rc, out, _ = run(["decode-cqe", good.hex()], monkeypatch, capsys)
    assert rc == 0 and "CQE REQ (opcode 0)" in out and "byte_cnt 4096" in out and "owner 0" in out


ENC = ["encode-wqe", "--wqe-index", "1", "--qpn", "2"]
ADDR = ["--laddr", "1", "--lkey", "2", "--raddr", "3", "--rkey", "4"]


@pytest.mark.parametrize("argv, needle", [
    (["decode-wqe", "zz" + "00" * 63], "'z' at hex digit 0 is not a hex digit"),
    (["decode-wqe", "00" * 63], "must be 128 hex digits (64 bytes), got 126"),
    (["decode-wqe", "0" * 127], "got 127"),
    (["decode-cqe", "00" * 65], "CQE must be 128 hex digits (64 bytes), got 130"),
    (["decode-cqe", "-"], "got 0"),
    (ENC + ["--opcode", "rdma_write"], "needs --laddr, --lkey, --raddr, --rkey, --length"),
    (ENC + ["--opcode", "rdma_write", "--length", "8"] + ADDR[:6], "needs --rkey"),
    (ENC + ["--opcode", "masked_fa32"] + ADDR, "needs --add"),
    (ENC + ["--opcode", "fa64", "--add", "1", "--length", "8"] + ADDR, "does not use --length"),
    (ENC + ["--opcode", "rdma_write", "--length", "8", "--add", "1"] + ADDR, "does not use --add"),
    (ENC + ["--opcode", "nop", "--raddr", "0"], "does not use --raddr"),
    (ENC + ["--opcode", "masked_fa32", "--add", "0x100000000"] + ADDR, "add=0x100000000 does not fit in 32 bits"),
    (ENC + ["--opcode", "nop", "--qpn", "0x1000000"], "argument --qpn: 0x1000000 does not fit in 24 bits"),
    (["encode-wqe", "--opcode", "nop", "--qpn", "1", "--wqe-index", "65536"], "does not fit in 16 bits"),
    (ENC + ["--opcode", "rdma_write", "--length", "0x80000000"] + ADDR, "does not fit in 31 bits"),
    (ENC + ["--opcode", "rdma_write", "--length", "8", "--lkey", "0x1ffffffff"] + ADDR[:2] + ADDR[4:],
     "argument --lkey"),
    (ENC + ["--opcode", "fa64", "--add", str(2**64)] + ADDR, "does not fit in 64 bits"),
    (ENC + ["--opcode", "nop", "--qpn", "-1"], "'-1' is not a non-negative decimal or 0x-hex number"),
    (ENC + ["--opcode", "nop", "--qpn", "0b11"], "'0b11' is not a non-negative"),
    (ENC + ["--opcode", "nop", "--qpn", "1e3"], "'1e3' is not"),
    (ENC + ["--opcode", "read"], "invalid choice: 'read'"),
    (["encode-wqe", "--opcode", "nop", "--qpn", "1"], "required: --wqe-index"),
    ([], "ACTION"),
])
def test_bad_input_exits_2(argv: List[str], needle: str, monkeypatch: MonkeyPatch,
                          capsys: CaptureFixture[str]) -> None:
    rc, out, err = run(argv, monkeypatch, capsys)
    assert rc == 2, (rc, out, err)
    assert needle in err and out == ""
    assert "Traceback" not in err


def test_action_registry(monkeypatch: MonkeyPatch) -> None:
    names = [a.name for a in qp_cli.all_actions()]
    assert {"encode-wqe", "decode-wqe", "decode-cqe"} <= set(names) and len(names) == len(set(names))

    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument("--n", type=qp_cli.uint_arg(8), required=True)

    extra = qp_cli.QpAction("echo-test", "test action", configure, lambda args: args.n)
    monkeypatch.setattr(qp_cli, "BUILTIN_ACTIONS", qp_cli.BUILTIN_ACTIONS + (extra,))
    monkeypatch.setattr(cli, "COMMANDS", {"qp": "pyep.cli.qp"})
    assert cli.main(["qp", "echo-test", "--n", "0x2a"]) == 42
    monkeypatch.setattr(qp_cli, "BUILTIN_ACTIONS", qp_cli.BUILTIN_ACTIONS + (extra,))
    with pytest.raises(RuntimeError, match="defined twice: echo-test"):
        qp_cli.all_actions()


def test_real_entry_point() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ok = subprocess.run([sys.executable, "-m", "pyep", "qp", "encode-wqe"] + WRITE_ARGS, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)
    assert (ok.returncode, ok.stdout.strip()) == (0, WRITE_HEX), ok.stderr
    bad = subprocess.run([sys.executable, "-m", "pyep", "qp", "decode-cqe", "xyz"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "pyep qp: error: CQE: 'x' at hex digit 0" in bad.stderr


def test_unloadable_engine_is_reported_not_a_traceback(monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    real_import = qp_cli.importlib.import_module

    def fake_import(name: str, *args: object, **kwargs: object) -> object:
        if name == "pyep._engine":
            raise ImportError("undefined symbol: something")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(qp_cli.importlib, "import_module", fake_import)
    rc, out, err = run(["decode-cqe", "00" * 64], monkeypatch, capsys)
    assert rc == 1 and out == "" and "native engine cannot be loaded (undefined symbol: something)" in err
