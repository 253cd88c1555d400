"""What a user installing pyep relies on: declared dependencies and build requirements, the supported
Python versions stated alike in pyproject.toml and README.md, the shipped configs found by name from any
directory, and a clear error (not a ModuleNotFoundError traceback) when torch is missing. The wheel
itself is built, installed and run by scripts/check_install.sh (part of scripts/test.sh)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any, Dict, List

import pytest

from pyep.config import ConfigError
from pyep.config import bundled
from pyep.config.bundled import bundled_dir, bundled_names, find_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> Dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")     # Python >= 3.11; 3.10 is checked by check_install.sh
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)


def _names(reqs: List[str]) -> List[str]:
    return [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs]


def test_dependencies_and_build_requirements_are_declared() -> None:
    meta = _pyproject()
    assert set(_names(meta["build-system"]["requires"])) >= {"setuptools", "wheel", "pybind11"}
    assert set(_names(meta["project"]["dependencies"])) == {"torch", "numpy", "pyyaml", "rich"}
    assert _names(meta["project"]["optional-dependencies"]["plots"]) == ["matplotlib"]


def test_supported_python_versions_agree() -> None:
    meta = _pyproject()
    stated = sorted(c.rsplit(":: ", 1)[1] for c in meta["project"]["classifiers"]
                    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert stated == ["3.10", "3.11", "3.12", "3.13"]
    assert meta["project"]["requires-python"] == ">=3.10"
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    assert "Python 3.10 to 3.13" in readme
    with open(os.path.join(ROOT, "scripts", "check_install.sh"), encoding="utf-8") as fh:
        script = fh.read()
    assert "python3.10 python3.11 python3.12 python3.13" in script     # what the install check tries


def test_a_shipped_config_is_found_by_name_from_anywhere(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)            # no configs/ here
    expect = os.path.join(ROOT, "configs", "cpu_reference.yaml")
    for arg in ("cpu_reference", "cpu_reference.yaml", "configs/cpu_reference.yaml"):
        assert os.path.samefile(find_config(arg), expect), arg
    assert "cpu_reference" in bundled_names() and "single_node" in bundled_names()


def test_a_file_that_exists_wins_over_the_shipped_one(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    os.makedirs("configs")
    with open("configs/cpu_reference.yaml", "w", encoding="utf-8") as fh:
        fh.write("name: mine\n")
    assert find_config("configs/cpu_reference.yaml") == "configs/cpu_reference.yaml"


def test_the_installed_layout_comes_first_and_a_foreign_configs_dir_is_ignored(tmp_path: Any,
                                                                                  monkeypatch: Any) -> None:
    site = tmp_path / "site-packages"
    pkg = site / "pyep"
    (site / "configs").mkdir(parents=True)              # another distribution's top-level "configs"
    (site / "configs" / "foreign.yaml").write_text("x: 1\n")
    pkg.mkdir()
    monkeypatch.setattr(bundled, "_PKG", str(pkg))
    monkeypatch.setattr(bundled, "_CHECKOUT", str(site))
    assert bundled_dir() is None and bundled_names() == []
    with pytest.raises(ConfigError, match="none found in this installation"):
        find_config("foreign")
    (pkg / "configs").mkdir()
    (pkg / "configs" / "cpu_reference.yaml").write_text("name: shipped\n")
    assert bundled_dir() == str(pkg / "configs")
    assert find_config("cpu_reference") == str(pkg / "configs" / "cpu_reference.yaml")


def test_build_py_copies_the_configs_into_the_package(tmp_path: Any) -> None:
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                         env=dict(os.environ, PYEP_CUDA="0"))
    assert out.returncode == 0, out.stderr[-3000:]
    shipped = sorted(os.listdir(tmp_path / "pyep" / "configs"))
    assert shipped == sorted(f for f in os.listdir(os.path.join(ROOT, "configs"))
                             if f.endswith(".yaml") or f == "README.md")


def _cli_without_torch(args: List[str], cwd: str) -> subprocess.CompletedProcess:
    # sys.modules["torch"] = None makes `import torch` fail as it does where torch is not installed.
    code = ("import sys; sys.modules['torch'] = None; from pyep.cli import main; "
            "raise SystemExit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.mark.parametrize("args", [["launch", "cpu_reference"], ["bench"], ["drill"]],
                         ids=["launch", "bench", "drill"])
def test_commands_that_need_torch_say_so(args: List[str], tmp_path: Any) -> None:
    out = _cli_without_torch(args, str(tmp_path))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"pyep {args[0]}: error: this command needs PyTorch" in out.stderr
    assert "Traceback" not in out.stderr and "ModuleNotFoundError" not in out.stderr
    assert not (tmp_path / "runs").exists()       # nothing was started


def test_commands_that_do_not_need_torch_run_without_it(tmp_path: Any) -> None:
    out = _cli_without_torch(["launch", "cpu_reference", "--dry-run"], str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "run directory: " + str(tmp_path / "runs") in out.stdout     # printed, under the cwd
    out = _cli_without_torch(["info"], str(tmp_path))
    assert out.returncode == 0 and out.stdout.startswith("pyep: engine="), out.stderr
