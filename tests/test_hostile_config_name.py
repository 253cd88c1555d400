"""Hostile config names given to `pyep launch NAME` (pyep/config/bundled.py): each is refused with a
ConfigError naming the argument and listing the shipped configs, and a good name resolves afterwards."""
from __future__ import annotations

import os
from typing import Any

import pytest

from pyep.cli import main
from pyep.config import ConfigError
from pyep.config.bundled import find_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = os.path.join(ROOT, "configs", "cpu_reference.yaml")

CASES = [
    pytest.param("no_such_job", id="unknown-name"),
    pytest.param("../configs/cpu_reference.yaml", id="parent-dir-escape"),
    pytest.param("/etc/cpu_reference.yaml", id="absolute-path-elsewhere"),
    pytest.param("other/cpu_reference", id="name-in-another-folder"),
    pytest.param("configs", id="the-folder-itself"),
    pytest.param("cpu_reference\0.yaml", id="nul-byte"),
    pytest.param("", id="empty"),
    pytest.param("cpu_reference.yml", id="wrong-suffix"),
]


@pytest.mark.parametrize("name", CASES)
def test_bad_name_is_refused_then_a_good_one_resolves(name: str, tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        find_config(name)
    text = str(info.value)
    assert "no such config file" in text and "cpu_reference" in text      # lists what is shipped
    assert os.path.samefile(find_config("cpu_reference"), GOOD)


@pytest.mark.parametrize("name", [CASES[0], CASES[1]])
def test_bad_name_on_the_command_line_exits_2(name: str, tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["launch", name, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "pyep launch: error: invalid config" in err and "shipped: " in err
    assert main(["launch", "cpu_reference", "--dry-run"]) == 0
    assert "# cpu-reference: local launcher" in capsys.readouterr().out
