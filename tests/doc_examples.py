"""The python examples of README.md and docs/*.md, and a runner that runs one the way its reader would.

An example is a fenced ```python block. Comment lines at its top tell how to run it, for the reader
and for this module alike:

    # run: torchrun --nproc-per-node 2 two_modes.py   (anything after the file name is prose)
    # needs: gpu

Without a `# run:` line an example runs as `python example.py`, one process. `# needs: gpu` makes
the CPU suite skip it (it runs on GPU machines, under the `gpu` marker). Any other `# run:` / `# needs:`
value is refused, so a typo cannot turn an example into one that is silently never run.

The runner starts the ranks itself with the variables torchrun gives each of them (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), from a scratch directory outside the checkout with the
checkout on PYTHONPATH (as an installed pyep would be), so each rank's output and exit status are its
own. Every wait is bounded; a rank that fails makes the others get a short grace, then be killed.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Printed by the wrapper once the example's code returned: a rank that printed it and still exited
# non-zero died while the interpreter shut down, which the report names as such.
DONE = "PYEP_DOC_EXAMPLE_DONE"
ABORT_WORDS = "terminate called"
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_RUN = re.compile(r"^#\s*run:\s*(.*)$", re.IGNORECASE)
_NEEDS = re.compile(r"^#\s*needs:\s*(\S+)", re.IGNORECASE)
_TORCHRUN = re.compile(r"^torchrun\s+--nproc[-_]per[-_]node[ =](\d+)\s+\S+\.py\b")
_PYTHON = re.compile(r"^python3?\s+\S+\.py\b")


class ExampleMarkError(ValueError):
    """An example's `# run:` / `# needs:` line says something this runner does not know."""


@dataclass(frozen=True)
class Example:
    path: str          # relative to the checkout
    line: int          # 1-based line of the opening fence
    code: str
    nproc: int = 1
    needs_gpu: bool = False

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: str = ROOT) -> List[str]:
    """README.md and docs/*.md (docs/results/ holds measurements, not examples)."""
    docs = os.path.join(root, "docs")
    pages = sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md"))
    return ["README.md"] + pages


def _marks(path: str, line: int, code: str) -> Dict[str, object]:
    nproc, gpu = 1, False
    for text in code.splitlines():
        text = text.strip()
        if not text.startswith("#"):
            break              # marks sit in the block's leading comments
        run, needs = _RUN.match(text), _NEEDS.match(text)
        if run:
            how = run.group(1).strip()
            m = _TORCHRUN.match(how)
            if m:
                nproc = int(m.group(1))
            elif not _PYTHON.match(how):
                raise ExampleMarkError(f"{path}:{line}: '# run: {how}' is neither 'python FILE.py' nor "
                                       "'torchrun --nproc-per-node N FILE.py'")
        elif needs:
            if needs.group(1).lower() != "gpu":
                raise ExampleMarkError(f"{path}:{line}: '# needs: {needs.group(1)}' (only 'gpu' is known)")
            gpu = True
    if nproc < 1:
        raise ExampleMarkError(f"{path}:{line}: --nproc-per-node must be >= 1")
    return {"nproc": nproc, "needs_gpu": gpu}


def extract(text: str, path: str) -> List[Example]:
    """The ```python blocks of one markdown text, with their marks."""
    out: List[Example] = []
    lang: Optional[str] = None
    start, body = 0, []          # type: int, List[str]
    for i, raw in enumerate(text.splitlines(), start=1):
        m = _FENCE.match(raw)
        if lang is None:
            if m:
                lang, start, body = m.group(2).lower(), i, []
            continue
        if m and not m.group(2):
            if lang == "python":
                code = "\n".join(body) + "\n"
                out.append(Example(path, start, code, **_marks(path, start, code)))  # type: ignore[arg-type]
            lang = None
            continue
        body.append(raw)
    if lang is not None:
        raise ExampleMarkError(f"{path}:{start}: code block never closed")
    return out


def all_examples(root: str = ROOT) -> List[Example]:
    found: List[Example] = []
    for rel in doc_files(root):
        with open(os.path.join(root, rel), encoding="utf-8") as fh:
            found.extend(extract(fh.read(), rel))
    return found


@dataclass
class RankOutcome:
    rank: int
    code: Optional[int]       # None: still running when the bound ran out (then killed)
    output: str
    finished_code: bool = field(init=False)

    def __post_init__(self) -> None:
        self.finished_code = DONE in self.output

    def tail(self, n: int = 25) -> str:
        lines = [ln for ln in self.output.splitlines() if ln.strip() != DONE]
        return "\n".join(lines[-n:])


@dataclass
class RunResult:
    example: Example
    ranks: List[RankOutcome]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(r.code == 0 and ABORT_WORDS not in r.output for r in self.ranks)

    def report(self) -> str:
        """What went wrong, rank by rank, in words (empty when every rank passed)."""
        parts: List[str] = []
        for r in self.ranks:
            if r.code == 0 and ABORT_WORDS not in r.output:
                continue
            if r.finished_code:
                what = (f"rank {r.rank}: the example's code ran to its end, then the process died at exit "
                        f"({_exit_words(r.code)}"
                        + ("; C++ 'terminate called' during interpreter shutdown" if ABORT_WORDS in r.output
                           else "") + ")")
            elif r.code is None:
                what = f"rank {r.rank}: still running after the bound; killed"
            else:
                what = f"rank {r.rank}: failed ({_exit_words(r.code)})"
            parts.append(f"{what}\n--- rank {r.rank} output (tail) ---\n{r.tail()}")
        if not parts:
            return ""
        return f"example {self.example.id} ({self.seconds:.1f} s):\n" + "\n".join(parts)


def _exit_words(code: Optional[int]) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_WRAPPER = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__'); "
            f"print({DONE!r}, flush=True)")


def run_example(example: Example, workdir: str, *, cpu_only: bool, timeout_s: float = 300.0,
                grace_s: float = 20.0) -> RunResult:
    """Runs the example on example.nproc ranks in workdir; cpu_only hides every GPU from it."""
    os.makedirs(workdir, exist_ok=True)
    script = os.path.join(workdir, "example.py")
    with open(script, "w", encoding="utf-8") as fh:
        fh.write(example.code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")     # gloo's own sockets on 127.0.0.1
    env.setdefault("OMP_NUM_THREADS", "1")         # as torchrun sets it; ranks share a few cores
    if cpu_only:
        env["CUDA_VISIBLE_DEVICES"] = ""
    n = example.nproc
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n),
               LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", ROLE_RANK="0", ROLE_WORLD_SIZE=str(n),
               TORCHELASTIC_RUN_ID="doc-example")
    procs, logs = [], []
    t0 = time.monotonic()
    for rank in range(n):
        log = open(os.path.join(workdir, f"rank{rank}.log"), "w+", encoding="utf-8")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-c", _WRAPPER, script], cwd=workdir, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))))
    deadline = t0 + timeout_s
    first_failure: Optional[float] = None
    while True:
        states = [p.poll() for p in procs]
        if all(s is not None for s in states):
            break
        now = time.monotonic()
        if first_failure is None and any(s not in (None, 0) for s in states):
            first_failure = now
        if now > deadline or (first_failure is not None and now > first_failure + grace_s):
            break
        time.sleep(0.1)
    codes: List[Optional[int]] = []
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
            codes.append(None)
        else:
            codes.append(p.returncode)
    outcomes = []
    for rank, (code, log) in enumerate(zip(codes, logs)):
        log.seek(0)
        outcomes.append(RankOutcome(rank, code, log.read()))
        log.close()
    return RunResult(example, outcomes, time.monotonic() - t0)
