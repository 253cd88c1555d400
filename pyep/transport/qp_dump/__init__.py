"""Live QP diagnostics: what every RC queue pair of a running job is doing (`pyep qp dump`).

For each QP the dump reads the gda::Qp device context the GPU posts through (qp.h) and, where it can,
the send CQ ring and the provider's own view (softnic statistics, or the DevX QP state):
producer indices (resv = WQEBBs reserved, ready = doorbell rung, cons = known complete), outstanding
WQEBBs, CQ consumer index, the QP's first error (from its error slot) and the newest error CQE in the
ring, decoded with pyep.wqe's names, and WQEs/bytes posted; plus totals per peer.

Sources. `qp_dump(obj)` works on any object with a `qp_contexts()` method (or an `_backend` attribute
that has one, which is how an EpBuffer delegates to its backend) returning, per QP, a `QpRef` or a
tuple `(peer, qp_info, cq_info, context[, provider])`: qp_info/cq_info are pyep.softnic QpInfo/CqInfo
or the provider dicts (qpn; cqes, log_size), `context` is the context's bytes, a torch tensor holding
them (any device), or its address (host or device memory), and `provider` is a pyep.softnic.SoftNic
or a DevX provider (optional).

Triggers in running jobs (`install_dump_triggers`): with PYEP_QP_DUMP_SIGNAL=SIGUSR1 (any signal
name or number a handler can catch: not SIGKILL or SIGSTOP) the signal writes `qp_dump-rank<r>.json` into $PYEP_QP_DUMP_DIR, else $PYEP_RUN_DIR,
else the working directory; with PYEP_QP_DUMP_TRIGGER=<file> a watcher thread does the same whenever
that file is created or touched (`pyep qp dump --trigger FILE` does that and waits for the dumps).

Modules: capture (reading QPs into dump documents, the softnic demo), files (writing dumps safely into
a shared directory, loading them back with every field checked), triggers (the signal / trigger-file
side in the ranks, and waiting for fresh dumps), text (a document as plain text). `pyep qp dump`
(pyep.cli.qp) only parses its flags and prints what these return.
"""
from __future__ import annotations

from .capture import (ERROR_KINDS, QP_STATES, QpRef, as_ref, demo_document, dump_document, dump_ref, last_error_cqe,
                      per_peer, qp_dump, read_context, refs_from_table, refs_of)
from .files import (FORMAT, MAX_DUMP_BYTES, DumpRejected, dump_paths, load_document, load_documents,
                    validate_document, write_document)
from .text import render_document
from .triggers import (DIR_ENV, SIGNAL_ENV, TRIGGER_ENV, TRIGGER_POLL_S, DumpTriggers, dump_dir,
                       install_dump_triggers, parse_signal, touch_trigger, wait_fresh)

__all__ = ["DIR_ENV", "ERROR_KINDS", "FORMAT", "MAX_DUMP_BYTES", "QP_STATES", "SIGNAL_ENV", "TRIGGER_ENV",
           "TRIGGER_POLL_S", "DumpRejected", "DumpTriggers", "QpRef", "as_ref", "demo_document", "dump_dir",
           "dump_document", "dump_paths", "dump_ref", "install_dump_triggers", "last_error_cqe", "load_document",
           "load_documents", "parse_signal", "per_peer", "qp_dump", "read_context", "refs_from_table", "refs_of",
           "render_document", "touch_trigger", "validate_document", "wait_fresh", "write_document"]
