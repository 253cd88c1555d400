"""Runs a plan's node commands, streams their output, and tears every node down when one fails.

Each node command (torchrun, or ssh running torchrun remotely) starts in its own session, so a whole
node can be signalled as a process group. A remote node's first stdin line is its environment and the
job secret (pyep.launch.guard --env-stdin). Termination order on failure, timeout or Ctrl-C:
remote nodes get their ssh stdin closed (the remote guard then stops torchrun), every node gets
SIGTERM (torchrun forwards it to its ranks), and whatever is alive `grace_s` later gets SIGKILL. Every
wait here is bounded.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, TextIO

from .guard import stdin_payload
from .plan import NodeCommand
from .progress import Progress, parse_progress
from .rank import RankExit, parse_exit, parse_rank_line

log = logging.getLogger("pyep.launch")

_POLL_S = 0.1
_DRAIN_S = 3.0          # after all nodes exited: how long to wait for their last output
_KILL_WAIT_S = 5.0      # after SIGKILL: how long to wait for the kernel to reap
# The line pyep.ep.elastic.membership logs when a restarted rank has been re-admitted.
_REJOIN_RE = re.compile(r"rank (\d+): admitted \(generation (\d+)\)")


@dataclass(frozen=True)
class RestartPolicy:
    """launcher.restart with policy "rank": commands are single ranks, restarted one at a time."""
    max_restarts: int
    delay_s: float
    run_dir: Optional[str] = None


class OutputSink(Protocol):
    def on_line(self, node: int, text: str) -> None: ...
    def on_progress(self, node: int, rank: int, progress: Progress) -> None: ...
    def on_status(self, text: str) -> None: ...


@dataclass
class NodeOutcome:
    index: int
    host: str
    returncode: Optional[int] = None
    seconds: float = 0.0
    torn_down: bool = False     # stopped by the launcher, not on its own


@dataclass
class SuperviseResult:
    exit_code: int
    reason: str
    nodes: List[NodeOutcome]
    ranks: Dict[int, RankExit] = field(default_factory=dict)
    seconds: float = 0.0


class Supervisor:
    def __init__(self, commands: List[NodeCommand], sink: OutputSink, *, timeout_s: float, grace_s: float,
                 log_dir: Optional[str] = None, base_env: Optional[Dict[str, str]] = None,
                 restart: Optional[RestartPolicy] = None, job_secret: Optional[bytes] = None):
        self.commands = commands
        self.sink = sink
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.log_dir = log_dir
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.procs: List[Optional[subprocess.Popen]] = [None] * len(commands)
        self.outcomes = [NodeOutcome(c.index, c.host) for c in commands]
        self.ranks: Dict[int, RankExit] = {}
        self._lines: "queue.Queue[tuple]" = queue.Queue()
        self._readers: List[threading.Thread] = []
        self._logs: List[Optional[TextIO]] = [None] * len(commands)
        self._start = 0.0
        self.restart = restart
        self._secret = job_secret        # for remote nodes: sent on their stdin (pyep.launch.guard)
        self.restarts: Dict[int, int] = {}
        self.events: List[Dict[str, object]] = []

    # -- process handling -------------------------------------------------------------------------
    def _spawn(self, i: int, cmd: NodeCommand) -> None:
        env = dict(self.base_env)
        if not cmd.remote:
            env.update(cmd.env)
        if i in self.restarts:
            env["PYEP_RESTART_COUNT"] = str(self.restarts[i])
        proc = subprocess.Popen(cmd.argv, cwd=cmd.cwd, env=env, start_new_session=True,
                                stdin=subprocess.PIPE if cmd.remote else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.procs[i] = proc
        if cmd.remote and proc.stdin is not None:
            # The node's environment and the job secret go on stdin, never on the ssh command line.
            try:
                proc.stdin.write(stdin_payload(cmd.env, self._secret))
                proc.stdin.flush()
            except OSError as exc:       # ssh already gone: its exit status says why
                log.warning("node %d (%s): could not send its environment: %s", i, cmd.host, exc)
        if self.log_dir:
            path = os.path.join(self.log_dir, f"node-{i}-{cmd.host}.log")
            self._logs[i] = open(path, "a", encoding="utf-8", errors="replace")
        t = threading.Thread(target=self._read, args=(i, proc), name=f"pyep-node{i}-reader", daemon=True)
        t.start()
        self._readers.append(t)

    def _read(self, i: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            self._lines.put((i, raw.decode("utf-8", errors="replace").rstrip("\r\n")))
        proc.stdout.close()
        self._lines.put((i, None))

    def _signal(self, i: int, sig: int) -> None:
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _close_stdin(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass

    def _running(self) -> List[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def _reap(self) -> Optional[int]:
        """Record newly finished nodes; return the index of the first one that failed, if any."""
        failed = None
        for i, proc in enumerate(self.procs):
            out = self.outcomes[i]
            if proc is None or out.returncode is not None:
                continue
            rc = proc.poll()
            if rc is None:
                continue
            out.returncode = rc
            out.seconds = time.monotonic() - self._start
            if rc != 0 and failed is None:
                failed = i
        return failed

    def _wait_until(self, deadline: float) -> None:
        while self._running() and time.monotonic() < deadline:
            self._pump(_POLL_S)
            self._reap()

    def teardown(self, why: str) -> None:
        running = self._running()
        if not running:
            return
        hosts = ", ".join(f"node {i} ({self.commands[i].host})" for i in running)
        self.sink.on_status(f"tearing down {hosts}: {why}")
        for i in running:
            self.outcomes[i].torn_down = True
            self._close_stdin(i)
        remote = [i for i in running if self.commands[i].remote]
        if remote:   # give remote guards the chance to stop torchrun over a live connection first
            self._wait_until(time.monotonic() + min(self.grace_s, 5.0))
        for i in self._running():
            self._signal(i, signal.SIGTERM)
        self._wait_until(time.monotonic() + self.grace_s)
        left = self._running()
        if left:
            self.sink.on_status(f"still alive after {self.grace_s:g} s: "
                                + ", ".join(f"node {i}" for i in left) + "; sending SIGKILL")
            for i in left:
                self._signal(i, signal.SIGKILL)
            for i in left:
                try:
                    self.procs[i].wait(timeout=_KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    log.error("node %d (pid %d) did not exit %.0f s after SIGKILL", i, self.procs[i].pid, _KILL_WAIT_S)
        self._reap()

    # -- output -----------------------------------------------------------------------------------
    def _pump(self, wait_s: float) -> bool:
        """Handle queued output for up to wait_s; False when nothing arrived."""
        try:
            i, text = self._lines.get(timeout=wait_s)
        except queue.Empty:
            return False
        self._handle(i, text)
        while True:
            try:
                i, text = self._lines.get_nowait()
            except queue.Empty:
                return True
            self._handle(i, text)

    def _handle(self, i: int, text: Optional[str]) -> None:
        if text is None:
            return
        fh = self._logs[i]
        if fh is not None:
            fh.write(text + "\n")
        parsed = parse_rank_line(text)
        if parsed is not None:
            rank, rest = parsed
            m = _REJOIN_RE.search(rest) if self.restart is not None else None
            if m is not None:
                self._event("rejoin", int(m.group(1)), generation=int(m.group(2)))
                self.sink.on_status(f"rank {m.group(1)} rejoined the job (generation {m.group(2)})")
            prog = parse_progress(rest)
            if prog is not None:
                self.sink.on_progress(i, rank, prog)
                return
            ex = parse_exit(rest)
            if ex is not None:
                self.ranks[ex.rank] = ex
                return
        self.sink.on_line(i, text)

    # -- single-rank restarts (launcher.restart.policy = "rank") -------------------------------------
    def _event(self, kind: str, rank: int, **extra: object) -> None:
        ev: Dict[str, object] = {"event": kind, "rank": rank, **extra}
        self.events.append(ev)
        if self.restart is not None and self.restart.run_dir:
            from .rundir import append_event
            append_event(self.restart.run_dir, ev)

    def _try_restart(self, i: int) -> bool:
        """Restart failed command i (one rank) if the policy allows; False: tear the job down."""
        pol = self.restart
        rc = self.outcomes[i].returncode
        rank = self.commands[i].first_rank if self.commands[i].first_rank is not None else i
        done = self.restarts.get(i, 0)
        self._event("failure", rank, returncode=rc, restarts_so_far=done)
        if pol is None or done >= pol.max_restarts:
            if pol is not None:
                self.sink.on_status(f"rank {rank} failed (status {rc}) and used all {pol.max_restarts} restarts")
            return False
        self.restarts[i] = done + 1
        self.sink.on_status(f"rank {rank} failed (status {rc}); restarting it alone "
                            f"(restart {done + 1} of {pol.max_restarts})")
        log.warning("pyep launch: rank %d failed (status %s); restart %d of %d", rank, rc, done + 1, pol.max_restarts)
        if pol.delay_s:
            end = time.monotonic() + pol.delay_s
            while time.monotonic() < end:
                self._pump(min(_POLL_S, max(0.0, end - time.monotonic())))
        self.outcomes[i].returncode = None
        self._spawn(i, self.commands[i])
        self._event("restart", rank, restart=done + 1, pid=self.procs[i].pid if self.procs[i] else None)
        return True

    # -- main loop --------------------------------------------------------------------------------
    def run(self) -> SuperviseResult:
        self._start = time.monotonic()
        deadline = self._start + self.timeout_s
        reason, code = "all nodes finished", 0
        try:
            for i, cmd in enumerate(self.commands):
                self._spawn(i, cmd)
            while True:
                self._pump(_POLL_S)
                failed = self._reap()
                if failed is not None and self.restart is not None and self._try_restart(failed):
                    continue
                if failed is not None:
                    rc = self.outcomes[failed].returncode
                    reason = f"node {failed} ({self.commands[failed].host}) exited with status {rc}"
                    code = rc if rc and rc > 0 else 1
                    self.teardown(reason)
                    break
                if not self._running():
                    break
                if time.monotonic() > deadline:
                    reason, code = f"timed out after {self.timeout_s:g} s (launcher.timeout_s)", 124
                    self.teardown(reason)
                    break
        except KeyboardInterrupt:
            reason, code = "interrupted (Ctrl-C)", 130
            try:
                self.teardown(reason)
            except KeyboardInterrupt:     # a second Ctrl-C: no more grace
                for i in self._running():
                    self._signal(i, signal.SIGKILL)
        except OSError as exc:
            reason, code = f"could not start node command: {exc}", 127
            self.teardown(reason)
        self._drain()
        return SuperviseResult(code, reason, self.outcomes, dict(self.ranks), time.monotonic() - self._start)

    def _drain(self) -> None:
        end = time.monotonic() + _DRAIN_S
        while time.monotonic() < end and any(t.is_alive() for t in self._readers):
            self._pump(_POLL_S)
        while self._pump(0.0):
            pass
        for fh in self._logs:
            if fh is not None:
                fh.close()
        self._reap()
