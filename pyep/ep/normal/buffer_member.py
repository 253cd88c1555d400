"""The elastic side of `NormalBuffer` (docs/elastic.md, "Normal mode"): the buffer's active_ranks mask,
and -- on a store-based buffer -- re-admitting a restarted rank through the same authenticated
membership protocol as the LL mode (pyep.ep.elastic.membership). A mixin, so that the calls reach
these as plain methods of the buffer.

A store-based buffer counts *steps*: a step begins with get_dispatch_layout. The membership's call #A
is a step number; every survivor admits the restarted rank inside the layout call of step A, before
its exchange, and hands it (in the act record) the call counters and the mask the survivors hold, so
the newcomer's first call -- the layout of step A -- carries the survivors' call number.
"""
from __future__ import annotations

import logging
import struct
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ..control import ControlTimeout
from ..elastic.membership import MemberView, Membership, MembershipError, Rejoin
from .errors import ElasticUnsupported

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyep.ep.normal")
# act payload: the survivors' generation (clean count) and call counter, then one byte per rank of their mask
_STEP = struct.Struct("<qq")


def check_active_ranks(active_ranks: Any, num_ranks: int) -> None:
    """active_ranks: int32 [num_ranks] of 0/1 (the LL buffer's mask), or None."""
    import torch
    if active_ranks is None:
        return
    if not isinstance(active_ranks, torch.Tensor):
        raise TypeError(f"active_ranks must be a torch.Tensor, got {type(active_ranks).__name__}")
    if active_ranks.dtype != torch.int32 or tuple(active_ranks.shape) != (num_ranks,):
        raise ValueError(f"active_ranks must be int32 [{num_ranks}] (1 = active), got {active_ranks.dtype} "
                         f"{list(active_ranks.shape)}")
    if bool(((active_ranks != 0) & (active_ranks != 1)).any()):
        raise ValueError("active_ranks must hold only 0 and 1")


class NormalBufferMembership(MemberView):
    """Mixed into NormalBuffer (which provides _backend, _device, _member, _control, _rank, _num_ranks,
    _mask, _step, _check_alive)."""

    _backend: Any
    _member: Optional[Membership]
    _control: Any
    _rank: int
    _num_ranks: int
    _mask: "torch.Tensor"
    _step: int

    # ------------------------------------------------------------------ the mask
    def get_active_ranks(self) -> "torch.Tensor":
        """A copy of the buffer's mask: int32 [R], 1 = active. The buffer clears an entry when that rank
        stops answering (a store-based buffer) and sets it again when the rank's restarted process is
        admitted; calls neither send to nor wait for a rank whose entry is 0."""
        self._check_alive("get_active_ranks")
        return self._mask.clone()

    @property
    def takes_active_ranks(self) -> bool:
        """Whether this buffer's calls can leave ranks out: the reference backend, the native
        intranode kernels and the internode kernels of an elastic buffer (rank to rank; a buffer forwarding
        over NVLink takes none: internode_member.py says why)."""
        return self._backend.name == "reference" or bool(getattr(self._backend, "takes_mask", False))

    @property
    def mask_device(self) -> "torch.device":
        """Where this buffer reads its mask: the native kernels on their GPU, the reference backend on its
        group's device (a store-based buffer's: the CPU)."""
        return self._device if self._backend.name != "reference" else self._mask.device

    def use_active_ranks(self, active_ranks: "torch.Tensor") -> None:
        """From the next call on, read `active_ranks` (int32 [R] on `mask_device`, 1 = active) as this
        buffer's mask, as if it had been given at construction: the caller's tensor, not a copy, so another
        user of it (the DeepEP shim's low-latency calls) and this buffer see each other's marks. Every rank
        switches between the same two calls. A store-based buffer keeps its own mask (its membership
        sets it); internode kernels forwarding over NVLink take none: ElasticUnsupported."""
        self._check_alive("use_active_ranks")
        check_active_ranks(active_ranks, self._num_ranks)
        if self._member is not None:
            raise MembershipError("use_active_ranks: a store-based buffer's mask follows its membership "
                                  "(poll_rejoin / update_ep_member)")
        if not self.takes_active_ranks:
            raise ElasticUnsupported("active_ranks= (a mask the caller holds)", self._backend.name)
        if active_ranks.device != self.mask_device:
            raise ValueError(f"active_ranks is on {active_ranks.device}; this buffer reads its mask on "
                             f"{self.mask_device}")
        if self._backend.name != "reference":
            self._attach_native_mask(active_ranks)     # the one place a native backend gets its mask
            return
        self._backend.mask = active_ranks      # it reads (and clears) the buffer's tensor itself
        self._mask = active_ranks

    def take_back_ranks(self, ranks: List[int]) -> None:
        """On a process group, between calls, on every rank alike: the caller set these entries of the
        mask it shares with this buffer (use_active_ranks) back to 1 -- ranks that stayed alive (the
        DeepEP shim's low_latency_update_mask_buffer(r, False) and low_latency_clean_mask_buffer). The
        native kernels restart the streams this rank shares with them and their gate flags in step (a
        rank whose own entry came back: with every peer); the reference backend needs nothing. A
        restarted process comes back through a store-based buffer's rejoin instead."""
        self._check_alive("take_back_ranks")
        if self._member is not None:
            raise MembershipError("take_back_ranks: a store-based buffer takes ranks back by their rejoin")
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self._num_ranks]
        if bad:
            raise ValueError(f"take_back_ranks: ranks must be ints in [0, {self._num_ranks}), got {bad}")
        still_out = [r for r in ranks if not int(self._mask[r])]
        if still_out:
            raise ValueError(f"take_back_ranks: ranks {still_out} are still 0 in the mask; set their entries to 1 "
                             f"first (the call only restarts what the masked stretch left behind)")
        if not ranks or self._backend.name == "reference":
            return
        if getattr(self._backend, "_mask", None) is None:
            raise ElasticUnsupported("take_back_ranks on a buffer whose kernels read no mask", self._backend.name)
        self._backend.take_back(sorted(set(ranks)))

    def _check_mask_supported(self) -> None:
        """A backend that takes no mask (internode kernels forwarding over NVLink: a buffer on nodes of
        several ranks built without elastic=True): one that leaves a rank out is an error there, never
        ignored (update_ep_member sets the buffer's own copy)."""
        if self._backend.name == "reference" or getattr(self._backend, "takes_mask", False):
            return
        out = [r for r, v in enumerate(self._mask.tolist()) if not v]
        if out:
            raise ElasticUnsupported(f"an active_ranks mask that leaves ranks {out} out", self._backend.name)

    def update_ep_member(self, active_ranks: Optional["torch.Tensor"] = None) -> None:
        """On a process group: set the buffer's mask (every rank must pass the same one; None: all
        active). Every call takes the AND of every rank's mask, so a rank left out by one is left out
        by all. On a store: a restarted rank joins, and each survivor waits (bounded) until the ranks it
        expects back -- those 1 in active_ranks but 0 in its mask, or all its 0s when None -- are
        admitted (as its next get_dispatch_layout would admit them)."""
        import torch
        self._check_alive("update_ep_member")
        check_active_ranks(active_ranks, self._num_ranks)
        member = self._member
        if member is None:
            want = active_ranks if active_ranks is not None else torch.ones_like(self._mask)
            if self._backend.name != "reference" and getattr(self._backend, "takes_mask", False):
                before = self._mask.tolist()
                back = [r for r, v in enumerate(want.tolist()) if v and not before[r]]
                if back:   # refused before the mask changes: the buffer keeps working as it was
                    raise ElasticUnsupported(f"taking ranks {back} back into the calls (a rejoin: their links are "
                                             f"not rebuilt yet)", self._backend.name)
                if getattr(self._backend, "_mask", None) is None:
                    if all(want.tolist()):
                        return     # all active and no mask yet: nothing changes
                    # The first mask of a native buffer: from now on its kernels read it (on the GPU).
                    mask = want.to(device=self._backend.device, dtype=torch.int32).contiguous().clone()
                    self._backend.set_mask(mask)
                    self._mask = mask
                    return
            self._mask.copy_(want.to(self._mask.device))
            self._check_mask_supported()
            return
        if member.joining:
            self.join()
            return
        expect = [r for r, v in enumerate(self._mask.tolist()) if not v]
        if active_ranks is not None:
            expect = [r for r in expect if active_ranks[r]]
        self._wait_admitted(expect, lambda: self._admit_step(self._step + 1, lead_calls=0), self._rank)

    # ------------------------------------------------------------------ rejoin (store-based buffers)
    @property
    def next_call(self) -> int:
        """The step the next get_dispatch_layout begins (store-based buffers; the same on every member)."""
        return self._step + 1

    def poll_rejoin(self) -> List[Rejoin]:
        """Non-blocking: learn of restarted ranks and report each one's stage and the step it joins at."""
        self._check_alive("poll_rejoin")
        if self._member is None:
            return []
        return self._member.poll(self._step + 1)

    def join(self, timeout_s: Optional[float] = None) -> int:
        """A restarted rank: wait (bounded) until the survivors admit it; returns the step its next
        get_dispatch_layout begins (the survivors' too). It takes the survivors' call counters and
        mask from their act records; they must agree."""
        member = self._member
        if member is None or not member.joining:
            raise MembershipError("join() is for a restarted rank of a store-based NormalBuffer")
        at = member.join(member.timeout_s if timeout_s is None else float(timeout_s), self._take_acts)
        self._step = at - 1
        return at

    def _take_acts(self, payloads: Dict[int, bytes]) -> None:
        """The survivors' call counters and mask (their act records; they must agree), in place before
        the newcomer tells them it is ready (Membership.join)."""
        import torch
        states = {s: _decode_act(p, self._num_ranks, s) for s, p in payloads.items()}
        counters = {v[:2] for v in states.values()}
        if len(counters) != 1:
            raise MembershipError(f"rank {self._rank}: the survivors sent different call counters: "
                                  f"{ {s: v[:2] for s, v in states.items()} }")
        epoch, calls = counters.pop()
        mask = torch.ones(self._num_ranks, dtype=torch.int32, device="cpu")
        for s, (_, _, m) in states.items():
            mask &= m
        mask[self._rank] = 1
        for s in states:
            mask[s] = 1
        self._mask.copy_(mask.to(self._mask.device))
        self._backend.take_step_state(epoch, calls)

    def _admit_step(self, step: int, lead_calls: Optional[int] = None) -> List[int]:
        """Survivor, at the start of step `step`: poll the membership and admit every restarted rank
        whose agreed step this is (its mask entry becomes 1; it gets the counters and the mask)."""
        member = self._member
        if member is None or member.joining:
            return []
        member.poll(step, lead_calls)
        admitted: List[int] = []
        for r in member.due(step):
            epoch, calls = self._backend.step_state()
            mask = self._mask.to("cpu").clone()
            mask[r] = 1
            payload = _STEP.pack(epoch, calls) + bytes(int(v) for v in mask.tolist())
            try:
                member.activate(r, step, None, payload)
            except ControlTimeout as exc:
                # The newcomer never confirmed (it died after announcing): this step runs without it, as
                # before; a newer process of the rank announces again.
                log.warning("rank %d: rank %d did not confirm its admission at step %d (%s); going on without it",
                            self._rank, r, step, exc)
                self._mask[r] = 0
                member.abandon(r)
                continue
            admitted.append(r)
            self._backend.open_grace()
        return admitted


def _decode_act(payload: bytes, num_ranks: int, src: int) -> Any:
    """(epoch, calls, mask int32 [R]) from survivor src's act record; MembershipError when malformed."""
    import torch
    if len(payload) != _STEP.size + num_ranks:
        raise MembershipError(f"act record of rank {src}: {len(payload)} bytes, expected {_STEP.size + num_ranks}")
    epoch, calls = _STEP.unpack_from(payload, 0)
    bits = list(payload[_STEP.size:])
    if epoch < 0 or calls < 0 or any(b not in (0, 1) for b in bits):
        raise MembershipError(f"act record of rank {src}: counters ({epoch}, {calls}) or mask {bits} out of range")
    return epoch, calls, torch.tensor(bits, dtype=torch.int32, device="cpu")
