"""Errors about what peers send (shared by both modes and the elastic control plane). The modes' own
errors are pyep.ep.ll.errors and pyep.ep.normal.errors; a control-plane wait that runs out is
pyep.ep.control.ControlTimeout."""
from __future__ import annotations


class MembershipError(RuntimeError):
    """The membership protocol cannot go on (wrong call order, a survivor missed call #A, ...)."""


class BadAnnouncement(MembershipError, ValueError):
    """A rejoin announcement that is malformed or does not fit this job."""


class StaleAnnouncement(BadAnnouncement):
    """An announcement of a generation that is not the rank's newest (or was already admitted)."""
