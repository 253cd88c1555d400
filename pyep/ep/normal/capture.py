"""Which normal-mode calls a CUDA graph capture can hold (docs/normal_mode.md, docs/normal_internode.md
"CUDA graphs"): the intranode and internode native paths ask `capture_refusal` before they launch
anything, and raise `errors.NotCapturable` with its reason."""
from __future__ import annotations

from typing import Optional


def capture_refusal(what: str, *, host_wait: bool, drains: bool, warmed: bool) -> Optional[str]:
    """Why a call cannot be captured now, or None.

    host_wait: the call sizes its outputs from counts the host reads (a dispatch without
    num_worst_tokens): the host would wait for kernels that do not run during a capture.
    drains/warmed: on the softnic under lazy module loading (internode_relay.drain_after_launch) a
    kernel first launched inside the capture is loaded there, and loading waits for the device to
    drain holding the context lock the softnic's progress thread needs: a replay in flight (its relay
    kernels spin until that thread serves them) then stalls until the relay's timeout. An eager call of
    the same kind before the capture (the warm-up a capture needs anyway) has loaded every kernel."""
    if host_wait:
        return (f"{what} without num_worst_tokens sizes its outputs from counts the host waits for, which a CUDA "
                f"graph capture cannot do: pass num_worst_tokens > 0 (outputs sized by that bound) to capture it")
    if drains and not warmed:
        return (f"{what} is captured on the softnic under lazy CUDA module loading before any eager call of the "
                f"same kind (same dtypes and options) ran on this buffer: make one such call first (it loads the "
                f"kernels the graph will hold; a kernel loaded during a capture may stall a replay in flight), or "
                f"set CUDA_MODULE_LOADING=EAGER")
    return None
