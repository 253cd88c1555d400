"""`pyep launch [CONFIG] [KEY=VALUE ...]`: run a YAML-described job with torchrun (local, ssh, Slurm).

With no CONFIG it runs the default local job: the EP benchmark on every GPU of this machine, or on a
machine without GPUs the CPU reference demo (4 gloo ranks). KEY=VALUE overrides any config key, typed
by the schema: `ep.timeout_us=5000000`, `nodes[0].gpus=[0,1]`, `workload.args=[--iters, 10]`.
"""
from __future__ import annotations

import argparse
import os
from typing import List, Tuple

from . import CliError, NeedsTorch, torch_importable


class _IntermixedParser(argparse.ArgumentParser):
    """Lets overrides follow options (`pyep launch x.yaml --dry-run ep.hidden=4096`): plain argparse
    stops collecting a positional list at the first option."""

    _inner = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._inner:      # parse_known_intermixed_args calls back into parse_known_args
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="launch a YAML-configured job (torchrun: local, ssh or slurm)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.__class__ = _IntermixedParser     # the subparsers action builds plain parsers; only the parsing differs
    p.add_argument("items", nargs="*", metavar="CONFIG|KEY=VALUE",
                   help="a config file, or the name of a shipped one (cpu_reference, configs/single_node.yaml), "
                        "and/or overrides such as ep.timeout_us=5000000")
    p.add_argument("--dry-run", action="store_true", help="print every command exactly, start nothing")
    p.add_argument("--submit", action="store_true", help="slurm: submit the generated script with sbatch")
    p.add_argument("--run-dir", help="where this run's files go (default: <launcher.run_root>/<timestamp>-<name>; "
                                     "run_root is 'runs' under the current directory unless the config says)")
    p.add_argument("--timeout", type=float, help="whole-job limit in seconds (launcher.timeout_s)")
    p.add_argument("--quiet", action="store_true", help="do not stream rank output; progress and summary only")
    p.set_defaults(func=run)


def split_items(items: List[str]) -> Tuple[str, List[str]]:
    """(config path or "", overrides). A token is the config when it names a file or has no '='."""
    config, overrides = "", []
    for item in items:
        if os.path.isfile(item) or "=" not in item:
            if config:
                raise CliError(f"more than one config given: {config!r} and {item!r}")
            config = item
        else:
            overrides.append(item)
    return config, overrides


def run(args: argparse.Namespace) -> int:
    from ..config import ConfigError, HostFacts, load_config
    from ..config.bundled import find_config
    from ..launch.runner import LaunchOptions, launch

    config, overrides = split_items(args.items)
    if args.timeout is not None:
        overrides.append(f"launcher.timeout_s={args.timeout!r}")
    if args.submit and args.dry_run:
        raise CliError("--submit and --dry-run exclude each other")
    facts = HostFacts.detect()
    try:
        config = find_config(config) if config else ""
        cfg = load_config(config or None, overrides, facts=facts)
    except ConfigError as exc:
        raise CliError(f"invalid config:\n{exc}") from None
    if cfg.launcher.kind == "local" and not args.dry_run and not torch_importable():
        raise NeedsTorch()      # the ranks would die at once on `import torch`, each with a traceback
    if args.submit and cfg.launcher.kind != "slurm":
        raise CliError(f"--submit is for the slurm launcher; this config uses {cfg.launcher.kind!r}")
    source = config or "<default config>"
    opts = LaunchOptions(dry_run=args.dry_run, submit=args.submit, quiet=args.quiet, run_dir=args.run_dir,
                         source=source)
    try:
        return launch(cfg, opts, facts)
    except ValueError as exc:      # e.g. a run directory sbatch cannot take
        raise CliError(str(exc)) from None
