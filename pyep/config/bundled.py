"""The job configs that ship with pyep, found by name from any directory:
`pyep launch cpu_reference`, `pyep launch cpu_reference.yaml` and `pyep launch configs/cpu_reference.yaml`
all name configs/cpu_reference.yaml, whether pyep runs from a checkout or from an installed wheel."""
from __future__ import annotations

import os
from typing import List, Optional

from .source import ConfigError, Problem

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CHECKOUT = os.path.dirname(_PKG)
SUFFIX = ".yaml"


def bundled_dir() -> Optional[str]:
    """Where the shipped configs are: inside the package when installed from a wheel (setup.py's
    build_py copies configs/ there), else configs/ of the checkout this package runs from (a checkout
    or an editable install), or None."""
    installed = os.path.join(_PKG, "configs")
    if os.path.isdir(installed):
        return installed
    # Only a directory next to pyproject.toml is ours: site-packages may hold another "configs".
    checkout = os.path.join(_CHECKOUT, "configs")
    if os.path.isdir(checkout) and os.path.isfile(os.path.join(_CHECKOUT, "pyproject.toml")):
        return checkout
    return None


def bundled_names(where: Optional[str] = None) -> List[str]:
    where = where or bundled_dir()
    if where is None:
        return []
    return sorted(f[:-len(SUFFIX)] for f in os.listdir(where) if f.endswith(SUFFIX))


def find_config(arg: str) -> str:
    """The config file `arg` means: the file itself when it exists; otherwise a shipped config named
    NAME, NAME.yaml or configs/NAME.yaml. ConfigError (listing the shipped names) when neither."""
    if os.path.isfile(arg):
        return arg
    head, base = os.path.split(os.path.normpath(arg))
    name = base[:-len(SUFFIX)] if base.endswith(SUFFIX) else base
    where = bundled_dir()
    names = bundled_names(where)
    if where is not None and head in ("", "configs") and name in names:
        return os.path.join(where, name + SUFFIX)
    shipped = ", ".join(names) if names else "none found in this installation"
    raise ConfigError([Problem(arg, "<file>", f"no such config file, and no shipped config of that name "
                                              f"(shipped: {shipped})")])
