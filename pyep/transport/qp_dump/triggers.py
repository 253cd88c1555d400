"""Dump triggers in running jobs (see the package docstring): a signal, or a trigger file a watcher
thread polls, makes a rank write its dump document; and the waiting side, for fresh dumps to appear.
"""
from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
import weakref
from typing import Any, List, Mapping, Optional

from ..._input import parse_uint
from .capture import dump_document
from .files import dump_paths, write_document

log = logging.getLogger("pyep.transport.qp_dump")

SIGNAL_ENV = "PYEP_QP_DUMP_SIGNAL"
TRIGGER_ENV = "PYEP_QP_DUMP_TRIGGER"
DIR_ENV = "PYEP_QP_DUMP_DIR"
TRIGGER_POLL_S = 0.5


# No handler can be installed for these, so a dump could never follow them.
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


def parse_signal(text: str) -> signal.Signals:
    t = text.strip().upper()
    num = parse_uint(t, 3)
    try:
        sig = signal.Signals(num) if num is not None else signal.Signals[t if t.startswith("SIG") else "SIG" + t]
    except (KeyError, ValueError):
        raise ValueError(f"${SIGNAL_ENV}={text!r} is not a signal name or number (e.g. SIGUSR1)") from None
    if sig in _UNCATCHABLE:
        raise ValueError(f"${SIGNAL_ENV}={text!r}: {sig.name} cannot be caught, so it cannot trigger a dump "
                         "(use SIGUSR1 or SIGUSR2)")
    return sig


class DumpTriggers:
    """The installed triggers of one source; close() removes them (the signal handler goes back to
    what it was before). The source is held weakly: a destroyed EpBuffer is simply not dumped."""

    def __init__(self, source: Any, rank: int, out_dir: str, sig: Optional[signal.Signals], trigger: str,
                 tag: str = "") -> None:
        self.rank, self.out_dir, self.trigger = rank, out_dir, trigger
        self.path = os.path.join(out_dir, f"qp_dump-rank{rank}{'-' + tag if tag else ''}.json")
        self._source = weakref.ref(source)
        self._sig = sig
        self._previous: Any = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if sig is not None:
            self._previous = signal.signal(sig, self._on_signal)
        if trigger:
            # The baseline is taken here, not in the thread: a touch right after installation must count.
            self._thread = threading.Thread(target=self._watch, args=(_mtime(trigger),), name=f"pyep-qp-dump-{rank}",
                                            daemon=True)
            self._thread.start()

    def dump(self, reason: str) -> Optional[str]:
        source = self._source()
        if source is None:
            return None
        path = write_document(dump_document(source, self.rank, reason), self.path)
        log.warning("rank %d: QP dump (%s) written to %s", self.rank, reason, path)
        return path

    def _on_signal(self, signum: int, frame: Any) -> None:
        try:
            self.dump(f"signal {signal.Signals(signum).name}")
        except OSError:   # raised here it would surface in whatever the rank was doing
            log.exception("rank %d: QP dump on signal failed", self.rank)
        prev = self._previous
        if callable(prev) and prev not in (signal.default_int_handler,):
            prev(signum, frame)

    def _watch(self, last: Optional[float]) -> None:
        while not self._stop.wait(TRIGGER_POLL_S):
            now = _mtime(self.trigger)
            if now is not None and now != last:
                try:
                    self.dump(f"trigger file {self.trigger}")
                except Exception:  # noqa: BLE001 - keep watching; the failure is logged
                    log.exception("rank %d: QP dump on trigger failed", self.rank)
            last = now

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * TRIGGER_POLL_S)
        if self._sig is not None and signal.getsignal(self._sig) == self._on_signal:
            if threading.current_thread() is threading.main_thread():
                signal.signal(self._sig, self._previous if self._previous is not None else signal.SIG_DFL)
            else:  # only the main thread may change handlers; a dead source makes ours a no-op anyway
                log.warning("QP dump handler for %s stays installed: close() ran outside the main thread",
                            self._sig.name)
        self._sig = None


def _mtime(path: str) -> Optional[float]:
    try:
        return os.stat(path).st_mtime_ns / 1e9
    except OSError:
        return None


def dump_dir(explicit: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> str:
    """Where the ranks write their dumps: `explicit`, else $PYEP_QP_DUMP_DIR, $PYEP_RUN_DIR, the working
    directory."""
    env = os.environ if environ is None else environ
    return explicit or env.get(DIR_ENV) or env.get("PYEP_RUN_DIR") or os.getcwd()


def install_dump_triggers(source: Any, rank: int, environ: Optional[Mapping[str, str]] = None,
                          out_dir: Optional[str] = None, tag: str = "") -> Optional[DumpTriggers]:
    """Installs the triggers the environment asks for (None if it asks for none). The signal handler
    can only be installed from the main thread; elsewhere that part is skipped with a warning."""
    env = os.environ if environ is None else environ
    sig_text, trigger = env.get(SIGNAL_ENV, "").strip(), env.get(TRIGGER_ENV, "").strip()
    if not sig_text and not trigger:
        return None
    sig = parse_signal(sig_text) if sig_text else None
    if sig is not None and threading.current_thread() is not threading.main_thread():
        log.warning("%s=%s ignored: signal handlers can only be installed from the main thread", SIGNAL_ENV, sig_text)
        sig = None
    where = dump_dir(out_dir, env)
    os.makedirs(where, exist_ok=True)
    return DumpTriggers(source, rank, where, sig, trigger, tag)


def touch_trigger(path: str) -> None:
    """Creates or touches the trigger file the ranks watch. Never blocks (opening a FIFO for writing
    would wait for a reader) and touches only a regular file; ValueError says what is in the way."""
    try:
        if os.path.exists(path) and not os.path.isfile(path):
            raise ValueError(f"trigger file {path} is not a regular file")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ValueError(f"trigger file {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"trigger file {path} is not a regular file")
        os.utime(fd)
    finally:
        os.close(fd)


def _mtime_or_zero(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:     # removed between the listing and the stat
        return 0.0


def wait_fresh(out_dir: str, since: float, count: int, wait_s: float, what: str) -> List[str]:
    """Waits for `count` dump files in out_dir written after `since`; TimeoutError names what is missing."""
    deadline = time.monotonic() + wait_s
    while True:
        fresh = [p for p in (dump_paths(out_dir) if os.path.isdir(out_dir) else []) if _mtime_or_zero(p) >= since]
        if len(fresh) >= count:
            return fresh
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {len(fresh)} of {count} fresh dump(s) appeared in {out_dir} within "
                               f"{wait_s:.0f} s (are the ranks running with {SIGNAL_ENV} / "
                               f"{TRIGGER_ENV} set, and writing to this directory?)")
        time.sleep(0.1)
