"""Hostile YAML job configs and overrides for `pyep launch` (issue 22): alias bombs, self-referencing
aliases, deep nesting, oversized, non-UTF-8, non-regular and unreadable files, numbers the YAML
reader chokes on, non-ASCII digits where a port, an index or an address belongs. Each case is refused
with a ConfigError naming the file (or override) before anything is built from it, and then the
healthy config loads from the same place."""
from __future__ import annotations

import os
from typing import Any, List

import pytest
from hostile_util import ROOT, assert_refused, run_cli
from pytest import CaptureFixture, MonkeyPatch

from pyep.config import (MAX_CONFIG_BYTES, MAX_DEPTH, ConfigError, ConfigRefused, HostFacts, load_config,
                         parse_nic_map, virtual_node_size)

FACTS = HostFacts(gpus=0, names=frozenset({"localhost", "127.0.0.1"}), cwd="/work")
HEALTHY_PATH = os.path.join(ROOT, "configs", "cpu_reference.yaml")
HEALTHY = open(HEALTHY_PATH, encoding="utf-8").read()


def laughs(levels: int) -> str:
    """The "billion laughs": each level a list of nine aliases of the one before (9**levels leaves; the
    700-byte file of the issue has 9 levels). At most 6 here, so that a regression costs tens of MB, not
    the gigabytes 9 levels took."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def block_nesting(depth: int) -> str:
    return "".join("  " * i + f"k{i}:\n" for i in range(depth)) + "  " * depth + "x: 1\n"


def round_trip(path: Any, overrides: List[str] = ()) -> None:  # type: ignore[assignment]
    """The healthy config, written where the hostile one was, loads and resolves."""
    if os.path.lexists(str(path)):
        if os.path.isdir(str(path)) and not os.path.islink(str(path)):
            os.rmdir(str(path))
        else:
            os.remove(str(path))
    with open(str(path), "w", encoding="utf-8") as f:
        f.write(HEALTHY)
    cfg = load_config(str(path), list(overrides), facts=FACTS)
    assert cfg.name == "cpu-reference" and cfg.ep.num_experts == 16


FILE_CASES = {
    "billion-laughs": (laughs(5), "cfg.yaml:1: <yaml>: anchor &l0: anchors and aliases are not allowed"),
    "billion-laughs-alias-first": ("l1: [*l0]\n" + laughs(6), "alias *l0"),
    "self-referencing-list": ("name: &x [*x]\n", "anchor &x"),
    "self-referencing-mapping": ("env: &e\n  A: *e\n", "anchor &e"),
    "merge-key": ("base: &b {hidden: 256}\nep:\n  <<: *b\n", "anchor &b"),
    "alias-without-anchor": ("name: *nothing\n", "alias *nothing"),
    "anchor-on-a-scalar": ("name: &n demo\n", "anchor &n"),
    "flow-nesting-5000": ("name: " + "[" * 5000 + "]" * 5000 + "\n", f"nested more than {MAX_DEPTH} levels"),
    "block-nesting-40": (block_nesting(40), f"nested more than {MAX_DEPTH} levels"),
    "integer-of-5000-digits": ("ep:\n  hidden: " + "1" * 5000 + "\n", "cfg.yaml:2: <yaml>: '1111"),
    "impossible-date": ("name: 2001-13-45\n", "cfg.yaml:1: <yaml>: '2001-13-45' cannot be read"),
    "control-character": ("name: a\x01b\n", "#x0001 is not allowed"),
}


@pytest.mark.parametrize("name", list(FILE_CASES))
def test_hostile_yaml_is_refused_naming_the_file(tmp_path: Any, name: str) -> None:
    text, needle = FILE_CASES[name]
    path = tmp_path / "cfg.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), facts=FACTS)
    assert needle in str(info.value) and str(path) in str(info.value)
    round_trip(path)


@pytest.mark.parametrize("name", ["billion-laughs", "self-referencing-list", "flow-nesting-5000"])
def test_refusals_are_config_refused(tmp_path: Any, name: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(FILE_CASES[name][0], encoding="utf-8")
    with pytest.raises(ConfigRefused):
        load_config(str(path), facts=FACTS)
    round_trip(path)


def _non_utf8(path: Any) -> None:
    path.write_bytes(b"name: caf\xe9\n")


def _utf16(path: Any) -> None:
    path.write_bytes(HEALTHY.encode("utf-16"))


def _oversized(path: Any) -> None:
    path.write_text(HEALTHY + "#" * (MAX_CONFIG_BYTES - len(HEALTHY)) + "\n")


def _directory(path: Any) -> None:
    path.mkdir()


def _fifo(path: Any) -> None:
    os.mkfifo(str(path))


def _missing(path: Any) -> None:
    pass


FILE_KINDS = {
    "non-utf8": (_non_utf8, "is not UTF-8 text (byte 9 is 0xe9)"),
    "utf16-with-bom": (_utf16, "is not UTF-8 text (byte 0 is 0xff)"),
    "over-the-size-limit": (_oversized, f"is larger than the limit of {MAX_CONFIG_BYTES} bytes"),
    "directory": (_directory, "is a directory, not a file"),
    "fifo": (_fifo, "is a FIFO, not a regular file"),
    "missing": (_missing, "no such config file"),
}


@pytest.mark.parametrize("kind", list(FILE_KINDS))
def test_config_file_that_cannot_be_read(tmp_path: Any, kind: str) -> None:
    make, needle = FILE_KINDS[kind]
    path = tmp_path / "cfg.yaml"
    make(path)
    with pytest.raises(ConfigRefused) as info:
        load_config(str(path), facts=FACTS)
    assert str(info.value) == f"{path}: <file>: {needle}"
    round_trip(path)


def test_unreadable_config_file(tmp_path: Any, monkeypatch: MonkeyPatch) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(HEALTHY)
    real_open = os.open

    def denied(p: Any, *args: Any, **kwargs: Any) -> int:   # root reads a mode-000 file, so deny it here
        if str(p) == str(path):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "open", denied)
        with pytest.raises(ConfigRefused, match="cfg.yaml: <file>: permission denied"):
            load_config(str(path), facts=FACTS)
    round_trip(path)


def test_empty_config_file_is_the_defaults(tmp_path: Any) -> None:
    """Documented: an empty file is an empty mapping, every section takes its default."""
    path = tmp_path / "cfg.yaml"
    path.write_text("")
    cfg = load_config(str(path), facts=HostFacts(gpus=2, names=FACTS.names, cwd="/work"))
    assert cfg.nodes[0].host == "localhost"
    round_trip(path)


OVERRIDES = {
    "override-alias-bomb": ("ep.num_experts=&a [*a]", ConfigRefused, "anchor &a"),
    "override-nesting-40": ("name=" + "[" * 40 + "]" * 40, ConfigRefused, "nested more than"),
    "override-index-superscript": ("nodes.\u00b2.procs=4", ConfigError, "bad override key"),
    "override-index-arabic": ("nodes[\u0663].procs=4", ConfigError, "bad override key"),
    "override-index-20-digits": ("nodes.99999999999999999999.procs=4", ConfigError, "bad override key"),
    "endpoint-port-superscript": ("rendezvous={endpoint: 'localhost:\u00b2'}", ConfigError, "is not HOST:PORT"),
    "master-addr-arabic-digits": ("rendezvous.master_addr=\u0661\u0662\u0667.0.0.1", ConfigError,
                                  "is not a valid host name or address"),
    "slurm-time-arabic-digits": ("launcher={kind: slurm, slurm: {time: '\u0663:00'}}", ConfigError,
                                 "is not a Slurm time"),
}


@pytest.mark.parametrize("name", list(OVERRIDES))
def test_hostile_override(tmp_path: Any, name: str) -> None:
    override, error, needle = OVERRIDES[name]
    path = tmp_path / "cfg.yaml"
    path.write_text(HEALTHY)
    with pytest.raises(error) as info:
        load_config(str(path), [override], facts=FACTS)
    assert needle in str(info.value)
    round_trip(path, ["nodes.0.procs=4", "ep.num_experts=16"])


@pytest.mark.parametrize("raw", ["\u00b2", "\u0663", " 2", "0", "1" * 30], ids=["superscript", "arabic", "space",
                                                                             "zero", "30-digits"])
def test_virtual_node_size_variable(raw: str) -> None:
    with pytest.raises(ValueError, match="PYEP_VIRTUAL_NODE_SIZE"):
        virtual_node_size({"PYEP_VIRTUAL_NODE_SIZE": raw})
    assert virtual_node_size({"PYEP_VIRTUAL_NODE_SIZE": "4"}) == 4


@pytest.mark.parametrize("raw", ["\u00b2=mlx5_0", "\u0663=mlx5_0", "0=", "=mlx5_0"])
def test_nic_map_variable(raw: str) -> None:
    with pytest.raises(ValueError, match="PYEP_NIC_MAP entry"):
        parse_nic_map(raw)
    assert parse_nic_map("0=mlx5_0,1=mlx5_1") == {0: "mlx5_0", 1: "mlx5_1"}


@pytest.mark.parametrize("argv,needle", [
    (["cfg.yaml"], "anchor &l0"),
    (["--dry-run", "ep.num_experts=&a [*a]"], "anchor &a"),
], ids=["launch-billion-laughs", "launch-override-alias"])
def test_launch_dry_run_refuses(tmp_path: Any, argv: List[str], needle: str, monkeypatch: MonkeyPatch,
                                capsys: CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(laughs(6))
    rc, _, err = run_cli(["launch", *argv, "--dry-run"], monkeypatch, capsys)
    assert_refused(rc, err, needle)
    rc, out, err = run_cli(["launch", HEALTHY_PATH, "--dry-run"], monkeypatch, capsys)
    assert rc == 0 and "pyep.launch.demo" in out, err
