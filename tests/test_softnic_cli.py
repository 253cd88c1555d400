"""`pyep softnic selftest`: the loopback self-test and its exit statuses."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("pyep._engine")

from pyep.cli import main  # noqa: E402


def test_selftest_passes_with_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["softnic", "selftest"]) == 0
    out = capsys.readouterr().out
    for name in ("writes+signals", "ring wraparound", "fa64 fetch", "rkey fault", "reset+reconnect"):
        assert name in out
    assert "FAIL" not in out and "PASS (5/5 checks)" in out


def test_selftest_json(capsys: pytest.CaptureFixture) -> None:
    assert main(["softnic", "selftest", "--json", "--iterations", "50", "--seed", "9"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True and len(result["checks"]) == 5
    assert all(c["ok"] for c in result["checks"])
    assert "50 writes" in result["checks"][0]["detail"]


def test_selftest_reports_failure(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import pyep.cli.softnic as cli

    def broken(lb, rng):  # a check that fails must show up as FAIL and exit status 1
        raise AssertionError("simulated wrong byte")

    monkeypatch.setattr(cli, "_fa64", broken)
    assert main(["softnic", "selftest"]) == 1
    out = capsys.readouterr().out
    assert "fa64 fetch" in out and "FAIL" in out and "simulated wrong byte" in out


@pytest.mark.parametrize("argv", [["softnic", "selftest", "--iterations", "0"], ["softnic"],
                                  ["softnic", "selftest", "--iterations", "x"]])
def test_bad_input_exit_status_2(argv, capsys: pytest.CaptureFixture) -> None:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse type errors
        rc = exc.code
    assert rc == 2
