"""Hostile input to `pyep bench`'s GPU-sharing and reporting paths (issue 22 item 6 convention): each case
gets a typed error (or the documented behaviour) and then a correct round trip."""
from __future__ import annotations

import argparse
import json
import os
from typing import List

import pytest

from pyep.bench.dist import plan_distributed
from pyep.bench.sharing import Sharing, detect_mps
from test_bench_sharing import _fake_control


class _Sync:
    """Stands in for Sync.gather_strings: every 'rank' sends what the test says."""

    def __init__(self, texts: List[str]) -> None:
        self.texts = texts
        self.comm = self.device = None
        self.staged = False
        self.backend = "gloo"

    def gather_strings(self, _text: str, _what: str) -> List[str]:
        return list(self.texts)


class _Cpu:
    type = "cpu"


def _sharing(texts: List[str]) -> Sharing:
    s = _Sync(texts)
    s.comm = _Cpu()
    return Sharing.gather(s, _Cpu())  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["no tabs at all", "h/gpu\tmany\tH100", "h/gpu\t132", ""],
                         ids=["no-fields", "sms-not-a-number", "name-missing", "empty"])
def test_peer_device_identity_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="malformed device identity"):
        _sharing(["h/cpu\t0\tCPU (x86_64)", text])
    ok = _sharing(["h/cpu\t0\tCPU (x86_64)", "h/cpu\t0\tCPU (x86_64)"])
    assert ok.world_size == 2 and ok.one_device and ok.where() == "2 ranks on the CPU (x86_64)"


@pytest.mark.parametrize("env,match", [
    ({"WORLD_SIZE": "4", "RANK": "4"}, "RANK=4 does not fit WORLD_SIZE=4"),
    ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE='two'"),
    ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_RANK=5"),
    ({"WORLD_SIZE": "-2"}, "WORLD_SIZE='-2'"),
], ids=["rank-beyond-world", "local-world-not-a-number", "local-rank-beyond-local-world", "negative-world"])
def test_launcher_variables(env: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_distributed("auto", "auto", {**env, "MASTER_ADDR": "127.0.0.1"}, gpus=1)
    plan = plan_distributed("auto", "auto", {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1",
                                             "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1"}, gpus=1)
    assert plan is not None and plan.shared and plan.device_index == 0


def _args(*argv: str) -> argparse.Namespace:
    from pyep.cli.bench import configure
    p = argparse.ArgumentParser()
    configure(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("value", ["-1", "70000"], ids=["copy-mb-negative", "copy-mb-huge"])
def test_copy_mb_out_of_range(value: str) -> None:
    from pyep.bench.normal_report import config_from_args
    with pytest.raises(ValueError, match="copy_mb"):
        config_from_args(_args("--mode", "normal", "--copy-mb", value), cuda=False)
    cfg, _ = config_from_args(_args("--mode", "normal", "--copy-mb", "0"), cuda=False)
    assert cfg.copy_mb == 0


def test_copy_mb_is_a_normal_mode_option() -> None:
    from pyep.cli import CliError
    from pyep.cli.bench import run
    with pytest.raises(CliError, match="--copy-mb is a normal-mode option"):
        run(_args("--copy-mb", "4"), {})
    from pyep.bench.normal_report import config_from_args
    assert config_from_args(_args("--mode", "normal", "--copy-mb", "4"), cuda=False)[0].copy_mb == 4


def test_combine_input_is_a_normal_mode_choice() -> None:
    from pyep.cli import CliError
    from pyep.cli.bench import run
    with pytest.raises(CliError, match="--combine-input is a normal-mode option"):
        run(_args("--combine-input", "pool"), {})
    with pytest.raises(SystemExit):
        _args("--mode", "normal", "--combine-input", "ring")
    from pyep.bench.normal import NormalBenchConfig
    with pytest.raises(ValueError, match="combine_input"):
        NormalBenchConfig(combine_input="ring")
    from pyep.bench.normal_report import config_from_args
    assert config_from_args(_args("--mode", "normal", "--combine-input", "pool"), cuda=False)[0].combine_input == "pool"


@pytest.mark.parametrize("content", ["[1, 2]", "{not json", ""], ids=["json-list", "json-broken", "json-empty"])
def test_deepep_json_not_a_document(tmp_path, content: str) -> None:  # type: ignore[no-untyped-def]
    from pyep.bench.deepep_run import deepep_figures
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    doc, note = deepep_figures("intranode", 2, [], str(tmp_path), json_path=str(bad))
    assert doc is None and "unavailable" in note
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"ok": True, "figures": {}}))
    doc, note = deepep_figures("intranode", 2, [], str(tmp_path), json_path=str(good))
    assert doc == {"ok": True, "figures": {}} and str(good) in note


def test_deepep_on_unknown_library(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pyep.bench.deepep_run import deepep_figures
    with pytest.raises(ValueError, match="on must be one of"):
        deepep_figures("intranode", 2, [], str(tmp_path), on="nccl")
    good = tmp_path / "shim.json"
    good.write_text(json.dumps({"ok": True, "on": "pyep", "figures": {}}))
    doc, note = deepep_figures("intranode", 2, [], str(tmp_path), json_path=str(good), on="pyep")
    assert doc is not None and doc["on"] == "pyep" and note.startswith("pyep's shim under DeepEP's test")


@pytest.mark.parametrize("answer", ["Cannot find MPS control daemon process", "12x 4242-"],
                         ids=["control-error-text", "control-garbage-pids"])
def test_mps_control_answers_garbage(tmp_path, monkeypatch, answer: str) -> None:  # type: ignore[no-untyped-def]
    path = os.environ.get("PATH", "")
    monkeypatch.setenv("PATH", _fake_control(tmp_path, answer) + os.pathsep + path)
    got = detect_mps({})
    assert got.on is False and "no MPS server" in got.how
    monkeypatch.setenv("PATH", _fake_control(tmp_path, "777") + os.pathsep + path)
    assert detect_mps({}).on is True
