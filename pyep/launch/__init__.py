"""`pyep launch`: YAML-described jobs on torchrun — this machine, ssh nodes, or Slurm.

Modules: plan (the exact commands), supervisor (run, stream, tear down), display (progress bar and
summary), rundir (run directory), slurm (sbatch script and node entry), rank (per-rank wrapper),
guard (remote teardown; an ssh node's environment and job secret arrive on its stdin), secret (the
per-job secret and the 0600 files), store (the job store, on one interface), progress (the
PYEP_PROGRESS protocol workloads print), demo (the reference-demo workload), elastic_demo (the elastic
workload), drill (`pyep drill`: runs, kills and restarts the ranks of the elastic drill and judges the
outcome). This package imports nothing heavy so that workloads can import `pyep.launch.progress` for
free; `launch()` and `LaunchOptions` load the runner on first use.
"""
from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("launch", "LaunchOptions"):
        from . import runner
        return getattr(runner, name)
    raise AttributeError(f"module 'pyep.launch' has no attribute {name!r}")


__all__ = ["launch", "LaunchOptions"]
