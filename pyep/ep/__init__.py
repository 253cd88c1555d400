"""The MoE expert-parallel library, one package per mode and one for membership:

- `pyep.ep.ll`: the low-latency mode (`EpBuffer`; docs/ll_kernels.md),
- `pyep.ep.normal`: the normal (high-throughput) mode (`NormalBuffer`; docs/normal_mode.md, and across
  nodes docs/normal_internode.md),
- `pyep.ep.elastic`: surviving a dead rank and taking it back (docs/elastic.md).

What they share lives here: the control plane (control.py: set-up exchanges over a process group or a
store; records.py: the authenticated store records and the job secret), the process-group helpers (_dist.py), the peer set that connects a buffer to every rank over the
transports (peers.py), the buffer configuration (config.py), argument checks (validate.py), errors about
peers' data (errors.py), the backend pieces both modes use (backend.py), CUDA stream helpers
(streams.py) and the FP8 definition (fp8.py). Shared modules import none of the three packages; `ll`
and `normal` never import each other. Importing this package does not import torch."""
