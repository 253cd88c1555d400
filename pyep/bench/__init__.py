"""`pyep bench`: the EP benchmark (dispatch / combine latency and bandwidth; LL and normal mode).

config     BenchConfig and RoutingSpec (checked before anything starts)
routing    routing generators: uniform, zipf, hot expert (+ dropped entries)
metrics    bytes per rank, GB/s, per-iteration statistics
guard      the correctness check run before timing (oracle, native vs reference)
runner     the timing loops of one case (wall times, then kineto per-kernel times on GPU)
kineto     attribution of profiled GPU kernels to phases and iterations
suite      the whole run: buffers per T, routings, gathering over ranks
report     tables, size hint, JSON;  plot: the PNG;  reference_numbers: DeepEP's measured figures
tables     the 120-column layout and small words of every table
dist       the process group and device of a rank, progress lines (both modes)
sharing    ranks that share a GPU: rank -> GPU, MPS on or off, how the run is named, the SM fit
sync       bounded barriers, device waits, gathers (staged through host memory on a gloo group)
normal*    the normal mode: normal (suite), normal_timer, normal_check (guard), normal_report, normal_plot
copy_rate  the device's memory copy rate of the same run, the bound of ranks sharing one GPU
deepep_run DeepEP's own test in the same run (tools/deepep_baseline.py), on DeepEP or pyep's shim

Importing this package does not import torch.
"""
from __future__ import annotations

from .config import BenchConfig, RoutingSpec

__all__ = ["BenchConfig", "RoutingSpec"]
