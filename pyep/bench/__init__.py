"""`pyep bench`: the low-latency EP benchmark (dispatch / combine latency and bandwidth).

config     BenchConfig and RoutingSpec (checked before anything starts)
routing    routing generators: uniform, zipf, hot expert (+ dropped entries)
metrics    bytes per rank, GB/s, per-iteration statistics
guard      the correctness check run before timing (oracle, native vs reference)
runner     the timing loops of one case (wall times, then kineto per-kernel times on GPU)
kineto     attribution of profiled GPU kernels to phases and iterations
suite      the whole run: buffers per T, routings, gathering over ranks
report     tables, size hint, JSON;  plot: the PNG;  reference_numbers: DeepEP's measured figures
dist       the process group and device of a rank, the device's name, progress lines (both modes)

Importing this package does not import torch.
"""
from __future__ import annotations

from .config import BenchConfig, RoutingSpec

__all__ = ["BenchConfig", "RoutingSpec"]
