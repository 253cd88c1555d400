"""Hostile input to `python -m pyep ...` (issue 22): QP dump files and the dump writer, `qp dump`'s
signal/trigger flags, WQE/CQE hex, loopback, softnic selftest, drill and bench arguments. Each bad input
gets exit status 2 and one line naming it (or the documented behaviour), never a traceback or a hang,
and then the same command with good input works. Saved sysfs trees: test_hostile_nic.py; YAML job
configs: test_hostile_config.py."""
from __future__ import annotations

import copy
import json
import os
import signal
import stat
import subprocess
import sys
from typing import Any, Dict, List

import pytest
from hostile_util import assert_refused, run_child, run_cli
from pytest import CaptureFixture, MonkeyPatch

from pyep.transport import qp_dump as qd
from pyep.transport.qp_dump import files as qd_files

QP = {"peer": 1, "index": 0, "qpn": 0x100, "sq_size": 16, "resv": 48, "ready": 48, "cons": 48, "signaled": 48,
      "outstanding": 0, "reserved_unrung": 0, "cq_ci": 12, "cq_size": 16, "cq_poll_locked": False,
      "wqes_posted": 48, "bytes_posted": 24576, "error": None, "state": "RTS", "last_error_cqe": None,
      "provider": {"kind": "softnic", "state": "RTS", "last_error": ""}}
HEALTHY: Dict[str, Any] = {
    "format": qd.FORMAT, "rank": 0, "host": "node-a", "pid": 1234, "time": 1.7e9, "reason": "api", "qps": [QP],
    "peers": [{"peer": 1, "qps": 1, "wqes_posted": 48, "bytes_posted": 24576, "outstanding": 0, "qps_in_error": 0}]}


def write_json(path: Any, doc: Any) -> str:
    with open(str(path), "w", encoding="utf-8") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def healthy_dump(path: Any, monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    write_json(path, HEALTHY)
    rc, out, err = run_cli(["qp", "dump", str(path)], monkeypatch, capsys)
    assert rc == 0 and "rank 0 on node-a" in out and "RTS" in out, err


def broken(path: str, value: Any) -> Dict[str, Any]:
    """HEALTHY with the field at `path` ("qps.0.qpn") set to `value`, or removed when value is DELETE."""
    doc = copy.deepcopy(HEALTHY)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = doc
    for p in parents:
        node = node[p]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


DELETE = object()
MALFORMED = {
    "qps-is-an-object": (broken("qps", {"0": QP}), "field qps: expected a list"),
    "qp-is-a-string": (broken("qps.0", "QP"), "field qps[0]: expected an object"),
    "qpn-is-a-string": (broken("qps.0.qpn", "0x100"), "field qps[0].qpn: expected an integer"),
    "qpn-missing": (broken("qps.0.qpn", DELETE), "field qps[0].qpn is missing"),
    "qpn-is-true": (broken("qps.0.qpn", True), "field qps[0].qpn: expected an integer, got True"),
    "peer-negative": (broken("qps.0.peer", -1), "field qps[0].peer: expected an integer, got -1"),
    "rank-is-a-string": (broken("rank", "0"), "field rank: expected an integer"),
    "time-1e300": (broken("time", 1e300), "field time: expected a number"),
    "time-nan": (json.dumps(HEALTHY).replace('"time": 1700000000.0', '"time": NaN'), "field time: expected a number"),
    "error-cqe-fields-missing": (broken("qps.0.error", {"kind_name": "error CQE", "syndrome_name": "X"}),
                                 "field qps[0].error.syndrome is missing"),
    "last-error-cqe-is-a-list": (broken("qps.0.last_error_cqe", []), "field qps[0].last_error_cqe: expected an object"),
    "peer-total-missing": (broken("peers.0.bytes_posted", DELETE), "field peers[0].bytes_posted is missing"),
    "provider-error-without-kind": (broken("qps.0.provider", {"last_error": "boom"}),
                                    "field qps[0].provider.kind is missing"),
    "json-nested-100000": ("[" * 100000 + "]" * 100000, "not a pyep QP dump"),
    "integer-of-5000-digits": ('{"format": "pyep-qp-dump/1", "rank": ' + "1" * 5000 + "}", "is not JSON"),
    "terminal-escape-in-host": (broken("host", "node\x1b]0;owned\x07"), "field host: expected a string of printable"),
    "wrong-format": (broken("format", "pyep-qp-dump/0"), "is not a pyep QP dump"),
    "empty-file": ("", "is not JSON"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_dump_file(tmp_path: Any, name: str, monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    doc, needle = MALFORMED[name]
    path = write_json(tmp_path / "qp_dump-rank0.json", doc)
    rc, _, err = run_cli(["qp", "dump", path], monkeypatch, capsys)
    assert_refused(rc, err, path, needle)
    with pytest.raises(qd.DumpRejected):
        qd.load_document(path)
    healthy_dump(path, monkeypatch, capsys)


def _non_utf8(path: Any) -> None:
    path.write_bytes(b'{"format": "\xff"}')


def _fifo(path: Any) -> None:
    os.mkfifo(str(path))


def _directory_without_dumps(path: Any) -> None:
    path.mkdir()


DUMP_FILES = {
    "non-utf8": (_non_utf8, "is not UTF-8 text (byte 12 is 0xff)"),
    "fifo": (_fifo, "is a FIFO, not a regular file"),
    "directory-without-dumps": (_directory_without_dumps, "holds no qp_dump-rank*.json files"),
}


@pytest.mark.parametrize("kind", list(DUMP_FILES))
def test_dump_path_that_is_not_a_dump(tmp_path: Any, kind: str, monkeypatch: MonkeyPatch,
                                      capsys: CaptureFixture[str]) -> None:
    make, needle = DUMP_FILES[kind]
    path = tmp_path / "x.json"
    make(path)
    rc, _, err = run_cli(["qp", "dump", str(path)], monkeypatch, capsys)
    assert_refused(rc, err, str(path), needle)
    healthy_dump(tmp_path / "qp_dump-rank0.json", monkeypatch, capsys)


def test_dump_larger_than_the_bound(tmp_path: Any, monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    path = write_json(tmp_path / "qp_dump-rank0.json", HEALTHY)
    with monkeypatch.context() as m:
        m.setattr(qd_files, "MAX_DUMP_BYTES", 100)
        rc, _, err = run_cli(["qp", "dump", path], monkeypatch, capsys)
    assert_refused(rc, err, "is larger than the limit of 100 bytes")
    healthy_dump(path, monkeypatch, capsys)


def test_dump_directory_with_a_superscript_rank(tmp_path: Any, monkeypatch: MonkeyPatch,
                                                capsys: CaptureFixture[str]) -> None:
    write_json(tmp_path / "qp_dump-rank\u00b2.json", broken("rank", 2))   # used to crash the sort
    write_json(tmp_path / "qp_dump-rank1.json", broken("rank", 1))
    rc, out, err = run_cli(["qp", "dump", str(tmp_path), "--json"], monkeypatch, capsys)
    assert rc == 0 and [d["rank"] for d in json.loads(out)] == [2, 1], err
    os.remove(tmp_path / "qp_dump-rank\u00b2.json")
    rc, out, _ = run_cli(["qp", "dump", str(tmp_path), "--json"], monkeypatch, capsys)
    assert rc == 0 and [d["rank"] for d in json.loads(out)] == [1]


# --------------------------------------------------------------------------- the writer
def test_writer_ignores_a_symlink_planted_at_the_old_temp_name(tmp_path: Any) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "qp_dump-rank0.json"
    os.symlink(str(victim), f"{target}.tmp{os.getpid()}")   # the name the writer used to write through
    qd.write_document(HEALTHY, str(target))
    assert victim.read_text() == "precious"
    assert qd.load_document(str(target)) == HEALTHY


def test_writer_replaces_a_symlink_at_the_target(tmp_path: Any) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "qp_dump-rank0.json"
    os.symlink(str(victim), str(target))
    qd.write_document(HEALTHY, str(target))
    assert victim.read_text() == "precious" and not os.path.islink(str(target))
    assert qd.load_document(str(target)) == HEALTHY


def test_writer_uses_a_private_directory_and_a_fresh_file(tmp_path: Any, monkeypatch: MonkeyPatch) -> None:
    seen: List[Any] = []
    real_open, real_replace = os.open, os.replace

    def spy_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        seen.append(("open", str(path), flags))
        return real_open(path, flags, *args, **kwargs)

    def spy_replace(src: Any, dst: Any) -> None:
        seen.append(("replace", str(src), stat.S_IMODE(os.stat(os.path.dirname(str(src))).st_mode)))
        real_replace(src, dst)

    target = str(tmp_path / "qp_dump-rank0.json")
    with monkeypatch.context() as m:
        m.setattr(os, "open", spy_open)
        m.setattr(os, "replace", spy_replace)
        qd.write_document(HEALTHY, target)
    opened = [s for s in seen if s[0] == "open"]
    replaced = [s for s in seen if s[0] == "replace"]
    assert len(opened) == 1 and opened[0][2] & os.O_EXCL and opened[0][2] & os.O_NOFOLLOW
    assert replaced and replaced[0][2] == 0o700 and os.path.dirname(replaced[0][1]) != str(tmp_path)
    assert os.listdir(str(tmp_path)) == ["qp_dump-rank0.json"]      # no private directory left behind
    assert qd.load_document(target) == HEALTHY


def test_writer_failure_leaves_nothing_behind(tmp_path: Any) -> None:
    target = tmp_path / "qp_dump-rank0.json"
    target.mkdir()                          # a directory where the dump goes
    with pytest.raises(OSError):
        qd.write_document(HEALTHY, str(target))
    assert sorted(os.listdir(str(tmp_path))) == ["qp_dump-rank0.json"]
    target.rmdir()
    qd.write_document(HEALTHY, str(target))
    assert qd.load_document(str(target)) == HEALTHY


# --------------------------------------------------------------------------- qp dump's flags
class _NoQps:
    def qp_contexts(self) -> List[Any]:
        return []


NO_QPS = _NoQps()      # the triggers hold their source weakly

@pytest.fixture
def triggers(tmp_path: Any) -> Any:
    t = qd.install_dump_triggers(NO_QPS, 0, environ={qd.SIGNAL_ENV: "SIGUSR1"}, out_dir=str(tmp_path))
    yield t
    t.close()


def signal_round_trip(tmp_path: Any, monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["qp", "dump", "--signal", str(os.getpid()), "--dir", str(tmp_path), "--wait", "20"],
                           monkeypatch, capsys)
    assert rc == 0 and "reason: signal SIGUSR1" in out and "no QPs" in out, err


# kill() reads 0 as "my process group" and -1 as "every process I may signal": never let them through.
@pytest.mark.parametrize("pids", ["0", "-1", "1,-1", "99999999999999999999", "4194305", "\u00b3", "1,,x"],
                         ids=["pid-0", "pid-minus-1", "pid-list-with-minus-1", "pid-20-digits", "pid-past-pid-max",
                              "pid-superscript", "pid-garbage"])
def test_signal_pids_are_checked(pids: str, tmp_path: Any, triggers: Any, monkeypatch: MonkeyPatch,
                                 capsys: CaptureFixture[str]) -> None:
    sent: List[Any] = []
    with monkeypatch.context() as m:
        m.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))    # a regression must not signal anyone
        rc, _, err = run_cli(["qp", "dump", "--signal", pids, "--dir", str(tmp_path), "--wait", "0.2"],
                             monkeypatch, capsys)
    assert_refused(rc, err, "--signal takes PIDs")
    assert sent == []
    signal_round_trip(tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("sig", ["SIGKILL", "9", "STOP"])
def test_uncatchable_signal_is_refused(sig: str, tmp_path: Any, triggers: Any, monkeypatch: MonkeyPatch,
                                       capsys: CaptureFixture[str]) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        rc, _, err = run_cli(["qp", "dump", "--signal", str(sleeper.pid), "--sig", sig, "--dir", str(tmp_path),
                              "--wait", "0.2"], monkeypatch, capsys)
        assert_refused(rc, err, "cannot be caught")
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait(10)
    with pytest.raises(ValueError, match="cannot be caught"):
        qd.install_dump_triggers(NO_QPS, 0, environ={qd.SIGNAL_ENV: sig})
    signal_round_trip(tmp_path, monkeypatch, capsys)


def test_signal_not_permitted(tmp_path: Any, triggers: Any, monkeypatch: MonkeyPatch,
                              capsys: CaptureFixture[str]) -> None:
    def denied(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    with monkeypatch.context() as m:
        m.setattr(os, "kill", denied)
        rc, _, err = run_cli(["qp", "dump", "--signal", "1", "--dir", str(tmp_path), "--wait", "0.2"],
                             monkeypatch, capsys)
    assert_refused(rc, err, "not allowed to signal process 1")
    signal_round_trip(tmp_path, monkeypatch, capsys)


def test_trigger_fifo_does_not_hang(tmp_path: Any, monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    fifo = str(tmp_path / "trigger")
    os.mkfifo(fifo)
    res = run_child(["qp", "dump", "--trigger", fifo, "--dir", str(tmp_path), "--wait", "0.2"], timeout_s=60)
    assert_refused(res.returncode, res.stderr, "--trigger", "is not a regular file")
    os.remove(fifo)
    rc, _, err = run_cli(["qp", "dump", "--trigger", fifo, "--dir", str(tmp_path), "--wait", "0.2"], monkeypatch,
                         capsys)
    assert rc == 1 and "0 of 1 fresh dump(s)" in err and os.path.isfile(fifo)    # touched; nobody dumped


@pytest.mark.parametrize("argv,needle", [
    (["--trigger", "{tmp}"], "--trigger"),
    (["--trigger", "{tmp}/missing/trigger"], "No such file or directory"),
    (["--trigger", "{tmp}/t", "--dir", "{tmp}/nowhere"], "--dir"),
    (["--trigger", "{tmp}/t", "--ranks", "99999999"], "--ranks"),
    (["--trigger", "{tmp}/t", "--wait", "nan"], "--wait"),
    (["--demo", "--wait", "inf"], "--wait"),
], ids=["trigger-is-a-directory", "trigger-in-missing-directory", "dir-missing", "ranks-huge", "wait-nan",
        "wait-inf"])
def test_dump_flags(argv: List[str], needle: str, tmp_path: Any, monkeypatch: MonkeyPatch,
                    capsys: CaptureFixture[str]) -> None:
    rc, _, err = run_cli(["qp", "dump", *[a.format(tmp=tmp_path) for a in argv]], monkeypatch, capsys)
    assert_refused(rc, err, needle)
    healthy_dump(tmp_path / "qp_dump-rank0.json", monkeypatch, capsys)


# --------------------------------------------------------------------------- WQE / CQE hex
@pytest.fixture(scope="module")
def nop_hex() -> str:
    pytest.importorskip("pyep._engine")
    from pyep import wqe
    return wqe.encode_wqe(wqe.WorkRequest(wqe.POSTED_OPCODES["nop"]), 3, 0x100).hex()


@pytest.mark.parametrize("argv,stdin,needle", [
    (["decode-wqe", "abc"], b"", "128 hex digits"),
    (["decode-wqe", "zz"], b"", "is not a hex digit"),
    (["decode-cqe", "0" * 129], b"", "128 hex digits"),
    (["decode-wqe", "-"], b"\xff\xfe" * 64, "stdin: is not UTF-8 text"),
    (["decode-cqe", "-"], b"0" * 70000, "more than 65536 bytes"),
    (["decode-wqe", "-"], b"", "128 hex digits"),
    (["encode-wqe", "--opcode", "nop", "--wqe-index", "65536", "--qpn", "1"], b"", "does not fit in 16 bits"),
    (["encode-wqe", "--opcode", "nop", "--wqe-index", "\u0663", "--qpn", "1"], b"", "not a non-negative"),
    (["encode-wqe", "--opcode", "nop", "--wqe-index", "1", "--qpn", "-1"], b"", "not a non-negative"),
    (["encode-wqe", "--opcode", "rdma_write", "--wqe-index", "1", "--qpn", "1", "--laddr", "1" * 5000, "--lkey", "1",
      "--raddr", "1", "--rkey", "1", "--length", "1"], b"", "--laddr"),
    (["encode-wqe", "--opcode", "rdma_write", "--wqe-index", "1", "--qpn", "1", "--laddr", "1", "--lkey", "1",
      "--raddr", "1", "--rkey", "1", "--length", str(1 << 31)], b"", "does not fit in 31 bits"),
], ids=["hex-odd-length", "hex-not-hex", "hex-129-digits", "stdin-non-utf8", "stdin-70000-bytes", "stdin-empty",
        "wqe-index-65536", "wqe-index-arabic", "qpn-negative", "laddr-5000-digits", "length-2-31"])
def test_wqe_codec_input(argv: List[str], stdin: bytes, needle: str, nop_hex: str, monkeypatch: MonkeyPatch,
                         capsys: CaptureFixture[str]) -> None:
    rc, _, err = run_cli(["qp", *argv], monkeypatch, capsys, stdin=stdin)
    assert_refused(rc, err, needle)
    rc, out, err = run_cli(["qp", "encode-wqe", "--opcode", "nop", "--wqe-index", "3", "--qpn", "0x100"],
                           monkeypatch, capsys)
    assert rc == 0 and out.strip() == nop_hex, err
    rc, out, err = run_cli(["qp", "decode-wqe", "-", "--json"], monkeypatch, capsys, stdin=nop_hex.encode())
    assert rc == 0 and json.loads(out)["wqe_index"] == 3 and json.loads(out)["opcode_name"] == "NOP", err


# --------------------------------------------------------------------------- loopback, softnic
@pytest.mark.parametrize("flag,value,needle", [
    ("--gpus", "\u00b2", "--gpus must be"), ("--gpus", "0,1,2", "--gpus must be"), ("--sizes", "0", "outside"),
    ("--sizes", "8,x", "is not a size"), ("--window", "0", "window"), ("--timeout", "nan", "timeout_s"),
    ("--iters", "-1", "--iters"), ("--warmup", "99999999999999999999", "warmup"),
], ids=["gpus-superscript", "gpus-three", "sizes-0", "sizes-garbage", "window-0", "timeout-nan", "iters-negative",
        "warmup-huge"])
def test_loopback_flags(flag: str, value: str, needle: str, monkeypatch: MonkeyPatch,
                        capsys: CaptureFixture[str]) -> None:
    base = ["qp", "loopback", "--poster", "cpu", "--nic", "softnic", "--iters", "2", "--warmup", "1", "--sizes", "8",
            "--test", "lat", "--json"]
    rc, _, err = run_cli(base + [flag, value], monkeypatch, capsys)
    assert_refused(rc, err, needle)
    pytest.importorskip("pyep._engine")
    rc, out, err = run_cli(base, monkeypatch, capsys)
    assert rc == 0 and json.loads(out)["latency"][0]["iterations"] == 2, err


@pytest.mark.parametrize("iterations", ["1", "39"])
def test_softnic_selftest_small_iterations(iterations: str, monkeypatch: MonkeyPatch,
                                           capsys: CaptureFixture[str]) -> None:
    pytest.importorskip("pyep._engine")
    rc, out, err = run_cli(["softnic", "selftest", "--json", "--iterations", iterations], monkeypatch, capsys)
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert rc == 0 and all(c["ok"] for c in checks.values()), checks
    assert f"{iterations} writes" in checks["writes+signals"]["detail"]
    assert "wrapped 10 times" in checks["ring wraparound"]["detail"]


@pytest.mark.parametrize("value", ["0", "-5", "1000001", "\u00b9"])
def test_softnic_selftest_iterations_out_of_range(value: str, monkeypatch: MonkeyPatch,
                                                  capsys: CaptureFixture[str]) -> None:
    rc, _, err = run_cli(["softnic", "selftest", "--iterations", value], monkeypatch, capsys)
    assert_refused(rc, err, "--iterations")
    pytest.importorskip("pyep._engine")
    rc, out, _ = run_cli(["softnic", "selftest", "--iterations", "2"], monkeypatch, capsys)
    assert rc == 0 and "PASS (5/5 checks)" in out


# --------------------------------------------------------------------------- drill, bench, info
DRILL_CASES = {
    "victim-7-of-2": (["--victim", "7"], "--victim must be an integer in [-1, 1]"),
    "victim-minus-2": (["--victim", "-2"], "--victim"),
    "world-1": (["--world", "1"], "--world"),
    "world-huge": (["--world", "99999999999"], "--world"),
    "experts-not-divisible": (["--experts", "3"], "--experts 3 is not divisible by --world 2"),
    "topk-above-experts": (["--experts", "2", "--topk", "4"], "--topk"),
    "topk-0": (["--topk", "0"], "--topk"),
    "hidden-not-multiple": (["--hidden", "200"], "--hidden must be a multiple of 128"),
    "tokens-0": (["--tokens", "0"], "--tokens"),
    "timeout-0": (["--timeout-us", "0"], "--timeout-us"),
    "slack-nan": (["--slack-ms", "nan"], "--slack-ms"),
    "slowdown-below-1": (["--max-slowdown", "0.5"], "--max-slowdown"),
    "drills-0": (["--drills", "0"], "--drills"),
    "rounds-after-0": (["--rounds-after", "0"], "--rounds-after"),
    "kill-call-in-grace-window": (["--kill-call", "5"], "--kill-call"),
    "transport-unknown": (["--transport", "carrier-pigeon"], "--transport"),
    "phases-empty": (["--phases", ","], "--phases"),
    "seed-negative": (["--seed", "-1"], "--seed"),
    "join-timeout-inf": (["--join-timeout-s", "inf"], "--join-timeout-s"),
    "json-is-a-directory": (["--json", "{tmp}"], "--json"),
    "json-in-missing-directory": (["--json", "{tmp}/no/such/out.json"], "--json"),
}


@pytest.mark.parametrize("name", list(DRILL_CASES))
def test_drill_arguments_checked_before_anything_starts(name: str, tmp_path: Any, monkeypatch: MonkeyPatch,
                                                        capsys: CaptureFixture[str]) -> None:
    import pyep.cli.drill as cli_drill
    from pyep.launch.drill import DrillOutcome
    started: List[Any] = []
    monkeypatch.setattr(cli_drill, "run_drill",
                        lambda cfg, i, phase, echo: started.append(cfg) or DrillOutcome(i, phase, ok=True))
    argv, needle = DRILL_CASES[name]
    rc, _, err = run_cli(["drill", "--world", "2", *[a.format(tmp=tmp_path) for a in argv]], monkeypatch, capsys)
    assert_refused(rc, err, needle)
    assert started == []
    rc, out, err = run_cli(["drill", "--world", "2", "--drills", "2", "--json", str(tmp_path / "d.json")],
                           monkeypatch, capsys)
    assert rc == 0 and "2/2 drills passed" in out and [c.victim_rank for c in started] == [1, 1], err
    assert len(json.loads((tmp_path / "d.json").read_text())["drills"]) == 2


BENCH = ["bench", "--device", "cpu", "--tokens", "8", "--hidden", "128", "--experts", "4", "--topk", "2",
         "--backend", "reference", "--iters", "1", "--warmup", "0", "--no-kineto", "--no-plot", "--no-hook",
         "--no-eager"]


def test_bench_output_checked_before_the_run(tmp_path: Any, monkeypatch: MonkeyPatch,
                                             capsys: CaptureFixture[str]) -> None:
    import pyep.cli.bench as cli_bench

    def must_not_start(*args: Any) -> Any:
        raise AssertionError("the benchmark started")

    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    (tmp_path / "file").write_text("x")
    with monkeypatch.context() as m:
        m.setattr(cli_bench, "_init_distributed", must_not_start)
        for argv, needle in ((["--out", str(tmp_path / "file")], "is not a directory"),
                             (["--out", str(tmp_path / "file" / "sub")], "is not a directory"),
                             (["--mode", "normal", "--deepep-json", fifo], "--deepep-json"),
                             (["--mode", "normal", "--deepep-json", str(tmp_path)], "--deepep-json")):
            rc, _, err = run_cli(BENCH + argv, monkeypatch, capsys)
            assert_refused(rc, err, needle)
    res = run_child(BENCH + ["--out", str(tmp_path / "run")], timeout_s=300)
    assert res.returncode == 0 and (tmp_path / "run" / "bench.json").is_file(), res.stderr[-2000:]


@pytest.mark.parametrize("argv", [["info", "extra"], ["bogus-command"], ["info", "--json=yes"]],
                         ids=["info-extra-argument", "unknown-command", "info-json-value"])
def test_unknown_arguments(argv: List[str], monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    rc, _, err = run_cli(argv, monkeypatch, capsys)
    assert rc == 2 and "Traceback" not in err and "error:" in err
    rc, out, _ = run_cli(["info", "--json"], monkeypatch, capsys)
    assert rc == 0 and "engine" in json.loads(out)


def test_signal_handler_write_failure_is_logged_not_raised(tmp_path: Any) -> None:
    (tmp_path / "qp_dump-rank0.json").mkdir()          # the dump cannot be written
    t = qd.install_dump_triggers(NO_QPS, 0, environ={qd.SIGNAL_ENV: "SIGUSR1"}, out_dir=str(tmp_path))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)         # used to raise IsADirectoryError into the running code
        os.rmdir(tmp_path / "qp_dump-rank0.json")
        os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        t.close()
    assert qd.load_document(str(tmp_path / "qp_dump-rank0.json"))["reason"] == "signal SIGUSR1"
