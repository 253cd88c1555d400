"""Hostile saved trees for `pyep nic` and `pyep doctor` (issue 22): FIFOs, devices-to-be and oversized
files where sysfs/procfs attributes belong, port and GID directories named with non-ASCII digits,
malformed /proc files. Each case shows the refusal or the documented behaviour (an attribute that is
not a small regular file reads as missing; an entry that is not a number is not a port) and then the
same tree, repaired, read correctly."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict

import pytest
from hostile_util import HOSTS, assert_refused, run_child, run_cli
from pytest import CaptureFixture, MonkeyPatch

from pyep.nic import SysfsView, load_host
from pyep.nic.sysfs import MAX_ATTRIBUTE_BYTES

PORT = "class/infiniband/mlx5_0/ports/1"


@pytest.fixture
def host(tmp_path: Any) -> str:
    """A private copy of the healthy InfiniBand host (its relative symlinks keep working)."""
    root = str(tmp_path / "ib_host")
    shutil.copytree(os.path.join(HOSTS, "ib_host"), root, symlinks=True)
    return root


def real(root: str, rel: str) -> str:
    path = SysfsView(os.path.join(root, "sys")).resolve(rel)
    assert path is not None, rel
    return os.path.join(root, "sys", path)


def roots(root: str) -> list:
    return ["--sysfs", os.path.join(root, "sys"), "--proc", os.path.join(root, "proc"), "--dev",
            os.path.join(root, "dev")]


def nic_json(root: str) -> Dict[str, Any]:
    res = run_child(["nic", "--json", *roots(root)], timeout_s=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout)


def doctor_json(root: str, monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> Dict[str, Any]:
    rc, out, err = run_cli(["doctor", "--json", *roots(root)], monkeypatch, capsys)
    assert rc in (0, 1) and "Traceback" not in err, err
    return {c["name"]: c for c in json.loads(out)["checks"]}


def port_state(doc: Dict[str, Any], nic: str = "mlx5_0") -> str:
    (dev,) = [d for d in doc["devices"] if d["name"] == nic]
    return dev["ports"][0]["state"]


def replace_with_fifo(path: str) -> str:
    saved = open(path).read()
    os.remove(path)
    os.mkfifo(path)
    return saved


def restore(path: str, text: str) -> None:
    os.remove(path)
    with open(path, "w") as f:
        f.write(text)


@pytest.mark.parametrize("attr", ["state", "link_layer", "rate"], ids=["fifo-port-state", "fifo-link-layer",
                                                                      "fifo-rate"])
def test_fifo_attribute_reads_as_missing_without_hanging(host: str, attr: str) -> None:
    path = real(host, f"{PORT}/{attr}")
    saved = replace_with_fifo(path)
    doc = nic_json(host)          # used to block forever in open()
    assert [d["name"] for d in doc["devices"]] == ["mlx5_0", "mlx5_1", "mlx5_2"]
    restore(path, saved)
    doc = nic_json(host)
    assert port_state(doc) == "ACTIVE" and doc["devices"][0]["ports"][0]["rate"].startswith("400")


def test_fifo_in_saved_proc_does_not_hang_doctor(host: str) -> None:
    path = os.path.join(host, "proc", "modules")
    saved = replace_with_fifo(path)
    res = run_child(["doctor", "--json", *roots(host)], timeout_s=60)
    assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res.stderr
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["GPU memory registration"]["status"] == "FAIL"     # no module list: no nvidia_peermem
    restore(path, saved)
    res = run_child(["doctor", "--json", *roots(host)], timeout_s=60)
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert res.returncode == 0 and checks["GPU memory registration"]["status"] == "PASS"


def test_fifo_gpu_information_in_proc(host: str) -> None:
    gpus = os.path.join(host, "proc", "driver", "nvidia", "gpus")
    path = os.path.join(gpus, sorted(os.listdir(gpus))[0], "information")
    saved = replace_with_fifo(path)
    doc = nic_json(host)
    assert doc["gpus"][0]["model"] == ""
    restore(path, saved)
    assert nic_json(host)["gpus"][0]["model"] != ""


@pytest.mark.parametrize("name", ["\u00b2", "\u0663", "01"], ids=["port-superscript-2", "port-arabic-3",
                                                                    "port-leading-zero"])
def test_port_directory_not_named_by_ascii_digits_is_ignored(host: str, name: str, monkeypatch: MonkeyPatch,
                                                              capsys: CaptureFixture[str]) -> None:
    ports = os.path.dirname(real(host, PORT))
    shutil.copytree(os.path.join(ports, "1"), os.path.join(ports, name), symlinks=True)
    checks = doctor_json(host, monkeypatch, capsys)     # '²' used to raise ValueError out of int()
    assert "mlx5_0:1 ACTIVE" in checks["RDMA devices"]["detail"]
    nic = load_host(*[os.path.join(host, d) for d in ("sys", "proc", "dev")]).nic("mlx5_0")
    assert [p.num for p in nic.ports] == [1]          # '٣' used to become a phantom port 3
    shutil.rmtree(os.path.join(ports, name))
    assert doctor_json(host, monkeypatch, capsys)["IBGDA readiness"]["status"] == "PASS"


def test_gid_named_by_superscript_digit_is_ignored(host: str, monkeypatch: MonkeyPatch,
                                                   capsys: CaptureFixture[str]) -> None:
    gids = os.path.dirname(real(host, f"{PORT}/gids/0"))
    shutil.copy(os.path.join(gids, "0"), os.path.join(gids, "\u00b9"))
    checks = doctor_json(host, monkeypatch, capsys)
    assert checks["IBGDA readiness"]["status"] == "PASS"
    nic = load_host(*[os.path.join(host, d) for d in ("sys", "proc", "dev")]).nic("mlx5_0")
    assert [g.index for g in nic.ports[0].gids] == [0]
    os.remove(os.path.join(gids, "\u00b9"))
    assert doctor_json(host, monkeypatch, capsys)["IBGDA readiness"]["status"] == "PASS"


def test_oversized_attribute_reads_as_missing(host: str) -> None:
    path = real(host, "class/infiniband/mlx5_0/fw_ver")
    saved = open(path).read()
    with open(path, "w") as f:
        f.write("2" * (MAX_ATTRIBUTE_BYTES + 1))
    assert next(d for d in nic_json(host)["devices"] if d["name"] == "mlx5_0")["fw_ver"] == ""
    restore(path, saved)
    assert next(d for d in nic_json(host)["devices"] if d["name"] == "mlx5_0")["fw_ver"] == saved.strip()


def test_directory_where_an_attribute_belongs(host: str) -> None:
    path = real(host, f"{PORT}/state")
    saved = open(path).read()
    os.remove(path)
    os.mkdir(path)
    assert port_state(nic_json(host)) == "UNKNOWN"
    os.rmdir(path)
    with open(path, "w") as f:
        f.write(saved)
    assert port_state(nic_json(host)) == "ACTIVE"


@pytest.mark.parametrize("line", ["Max locked memory         \u00b2                    unlimited            bytes",
                                  "Max locked memory         " + "9" * 5000 + " unlimited bytes"],
                         ids=["memlock-superscript", "memlock-5000-digits"])
def test_malformed_memlock_line_is_unknown(host: str, line: str, monkeypatch: MonkeyPatch,
                                           capsys: CaptureFixture[str]) -> None:
    path = os.path.join(host, "proc", "self", "limits")
    saved = open(path).read()
    with open(path, "w") as f:
        f.write("\n".join(line if ln.startswith("Max locked memory") else ln for ln in saved.splitlines()) + "\n")
    checks = doctor_json(host, monkeypatch, capsys)     # used to raise ValueError out of int()
    assert checks["memlock"]["status"] == "WARN" and "unknown" in checks["memlock"]["detail"]
    restore(path, saved)
    assert doctor_json(host, monkeypatch, capsys)["memlock"]["status"] == "PASS"


def test_non_utf8_device_name_is_skipped(host: str, monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    cls = os.path.join(host, "sys", "class", "infiniband")
    bad = os.path.join(os.fsencode(cls), b"mlx5_\xff")
    os.symlink(os.readlink(os.path.join(cls, "mlx5_0")), bad)
    rc, out, err = run_cli(["nic", *roots(host)], monkeypatch, capsys)   # text tables: a surrogate cannot print
    assert rc == 0 and "mlx5_0" in out and "Traceback" not in err
    rc, out, _ = run_cli(["nic", "--json", *roots(host)], monkeypatch, capsys)
    assert rc == 0 and [d["name"] for d in json.loads(out)["devices"]] == ["mlx5_0", "mlx5_1", "mlx5_2"]
    os.remove(bad)
    rc, out, _ = run_cli(["nic", *roots(host)], monkeypatch, capsys)
    assert rc == 0 and "mlx5_0" in out


@pytest.mark.parametrize("argv,needle", [
    (["nic", "--hca", "mlx5_0:\u0663"], "port in"),
    (["nic", "--hca", "mlx5_0:0"], "port in"),
    (["nic", "--gid-index", "\u00b2"], "--gid-index"),
    (["nic", "--port", "256"], "port=256"),
], ids=["hca-arabic-port", "hca-port-0", "gid-index-superscript", "port-256"])
def test_bad_selection_flags(host: str, argv: list, needle: str, monkeypatch: MonkeyPatch,
                             capsys: CaptureFixture[str]) -> None:
    rc, _, err = run_cli(argv + roots(host), monkeypatch, capsys)
    assert_refused(rc, err, needle)
    rc, out, err = run_cli(["nic", "--hca", "mlx5_0:1", "--json", *roots(host)], monkeypatch, capsys)
    assert rc == 0 and {r["nic"] for r in json.loads(out)["selection"]} == {"mlx5_0"}


@pytest.mark.parametrize("flag", ["--sysfs", "--proc", "--dev"])
def test_tree_root_that_is_a_fifo(host: str, tmp_path: Any, flag: str, monkeypatch: MonkeyPatch,
                                  capsys: CaptureFixture[str]) -> None:
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    argv = roots(host)
    argv[argv.index(flag) + 1] = fifo
    for cmd in ("nic", "doctor"):
        rc, _, err = run_cli([cmd, *argv], monkeypatch, capsys)
        assert_refused(rc, err, flag, "is not a directory")
    assert doctor_json(host, monkeypatch, capsys)["RDMA devices"]["status"] == "PASS"


@pytest.mark.parametrize("cmd", ["nic", "doctor"])
def test_markup_and_terminal_escapes_in_the_tree_are_printed_as_text(host: str, cmd: str, monkeypatch: MonkeyPatch,
                                                                     capsys: CaptureFixture[str]) -> None:
    path = real(host, f"{PORT}/rate")
    saved = open(path).read()
    with open(path, "w") as f:
        f.write("[/bogus] 400 \x1b[2J")    # a rich closing tag raised MarkupError; ESC would reach the terminal
    monkeypatch.setenv("COLUMNS", "400")
    rc, out, err = run_cli([cmd, *roots(host)], monkeypatch, capsys)
    assert rc == 0 and "[/bogus] 400 \ufffd[2J" in out and "\x1b" not in out and "Traceback" not in err, err
    restore(path, saved)
    rc, out, _ = run_cli([cmd, *roots(host)], monkeypatch, capsys)
    assert rc == 0 and "400 Gb/sec (4X NDR)" in out


def test_tree_path_with_markup(tmp_path: Any, monkeypatch: MonkeyPatch, capsys: CaptureFixture[str]) -> None:
    root = tmp_path / "[/x]"
    (root / "sys").mkdir(parents=True)
    rc, out, err = run_cli(["nic", "--sysfs", str(root / "sys")], monkeypatch, capsys)
    assert rc == 0 and "no RDMA device found" in out and "Traceback" not in err, err
    shutil.copytree(os.path.join(HOSTS, "ib_host", "sys"), str(root / "sys2"), symlinks=True)
    rc, out, _ = run_cli(["nic", "--sysfs", str(root / "sys2"), "--json"], monkeypatch, capsys)
    assert rc == 0 and len(json.loads(out)["devices"]) == 3
