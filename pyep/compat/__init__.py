"""Drop-in shims for code written against other EP libraries: `pyep.compat.deep_ep` (DeepEP's `deep_ep`
module: V1's Buffer, V2's ElasticBuffer) and `pyep.compat.mooncake.Buffer` (Mooncake EP's
`mooncake.mooncake_ep_buffer`).

Existing code keeps its imports after one opt-in line, run before it imports them:

    import pyep.compat; pyep.compat.install_deep_ep_alias()      # `import deep_ep` now gives pyep's
    import pyep.compat; pyep.compat.install_mooncake_alias()     # `from mooncake.mooncake_ep_buffer ...`

An alias never hides a real installation: when the real package is importable the call raises (pass
force=True to shadow it anyway, with a warning). docs/compat.md lists what the shims support.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Dict, List

log = logging.getLogger("pyep.compat")
__all__ = ["install_deep_ep_alias", "install_mooncake_alias", "AliasConflict"]


class AliasConflict(RuntimeError):
    """A real installation of the aliased package is importable."""


def _is_ours(mod: object) -> bool:
    return getattr(mod, "__pyep_alias__", False) or getattr(mod, "__name__", "").startswith("pyep.compat")


def _real_origin(name: str) -> str:
    """Where a real (non-pyep) `name` would be imported from, or '' if none."""
    mod = sys.modules.get(name)
    if mod is not None:
        return "" if _is_ours(mod) else str(getattr(mod, "__file__", None) or mod)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return ""
    return "" if spec is None else str(spec.origin or spec.submodule_search_locations or name)


def _install(aliases: Dict[str, types.ModuleType], top: str, force: bool) -> List[str]:
    origin = _real_origin(top)
    if origin:
        msg = (f"a real '{top}' is importable ({origin}); pyep will not shadow it. Uninstall it, or pass "
               f"force=True to make '{top}' resolve to pyep's shim in this process")
        if not force:
            raise AliasConflict(msg)
        log.warning("shadowing the real '%s' (%s) with pyep's shim (force=True)", top, origin)
    for name, mod in aliases.items():
        sys.modules[name] = mod
    log.info("'%s' now resolves to pyep's shim in this process", top)
    return sorted(aliases)


def install_deep_ep_alias(force: bool = False) -> List[str]:
    """Make `import deep_ep` (and deep_ep.buffer) resolve to pyep.compat.deep_ep and deep_ep.utils (its
    EventOverlap and EventHandle, which Megatron-LM imports from there) to pyep.compat._events.
    Returns the module names installed; raises AliasConflict if a real DeepEP is importable."""
    from . import _events, deep_ep
    return _install({"deep_ep": deep_ep, "deep_ep.buffer": deep_ep, "deep_ep.utils": _events}, "deep_ep", force)


def install_mooncake_alias(force: bool = False) -> List[str]:
    """Make `from mooncake.mooncake_ep_buffer import Buffer` resolve to pyep.compat.mooncake.
    `mooncake` becomes a package holding only that module (Mooncake's transfer engine, store and
    process-group backend are not provided). Raises AliasConflict if a real Mooncake is importable."""
    from . import mooncake
    pkg = types.ModuleType("mooncake", "pyep's stand-in for Mooncake: only mooncake_ep_buffer")
    pkg.__path__ = []                  # a package, so `import mooncake.x` looks in sys.modules first
    pkg.__spec__ = importlib.machinery.ModuleSpec("mooncake", None, is_package=True)
    pkg.__pyep_alias__ = True          # type: ignore[attr-defined]
    pkg.mooncake_ep_buffer = mooncake  # type: ignore[attr-defined]
    return _install({"mooncake": pkg, "mooncake.mooncake_ep_buffer": mooncake}, "mooncake", force)
