"""Progress protocol, per-rank wrapper, remote guard, display, run directory helpers."""
from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from typing import List, Tuple

import pytest
from rich.console import Console

from pyep.launch import rundir
from pyep.launch.display import LaunchDisplay, rank_rows, render_summary
from pyep.launch.progress import Progress, format_progress, parse_progress, report
from pyep.launch.rank import parse_exit, parse_rank_line
from pyep.launch.supervisor import NodeOutcome, SuperviseResult

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)


def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.update(extra)
    return env


def test_progress_protocol() -> None:
    assert format_progress(3, 10, "case\nwith  spaces") == "PYEP_PROGRESS 3/10 case with spaces"
    assert parse_progress("PYEP_PROGRESS 3/10 case a") == Progress(3, 10, "case a")
    assert parse_progress("PYEP_PROGRESS 0/0") == Progress(0, 0, "")
    assert parse_progress("PYEP_PROGRESS 11/10 x") is None
    assert parse_progress("progress 1/2") is None
    with pytest.raises(ValueError):
        format_progress(5, 4)
    with pytest.raises(TypeError):
        format_progress(1.5, 4)  # type: ignore[arg-type]
    buf = io.StringIO()
    report(1, 2, "half", stream=buf)
    assert buf.getvalue() == "PYEP_PROGRESS 1/2 half\n"


def test_rank_line_parsing() -> None:
    assert parse_rank_line("[rank 12] hello [x]") == (12, "hello [x]")
    assert parse_rank_line("torchrun says hi") is None
    ex = parse_exit("PYEP_RANK_EXIT rank=3 code=-15 seconds=1.250")
    assert ex is not None and (ex.rank, ex.code, ex.seconds) == (3, -15, 1.25)


def test_rank_wrapper_prefixes_logs_and_propagates_status(tmp_path) -> None:
    script = tmp_path / "w.py"
    script.write_text("import sys\nprint('out line')\nprint('err line', file=sys.stderr)\nsys.exit(7)\n")
    out = subprocess.run([sys.executable, "-m", "pyep.launch.rank", "script", str(script)], capture_output=True,
                         text=True, timeout=60, env=_env(RANK="5", PYEP_RUN_DIR=str(tmp_path / "run")), cwd=ROOT)
    assert out.returncode == 7
    lines = out.stdout.splitlines()
    assert "[rank 5] out line" in lines and "[rank 5] err line" in lines
    assert parse_exit(parse_rank_line(lines[-1])[1]).code == 7
    log = (tmp_path / "run" / "logs" / "rank-00005.log").read_text()
    assert "out line" in log and "err line" in log and "exit code 7" in log


def test_rank_wrapper_forwards_sigterm(tmp_path) -> None:
    script = tmp_path / "sleepy.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "pyep.launch.rank", "--grace", "5", "script", str(script)],
                            stdout=subprocess.PIPE, text=True, env=_env(RANK="0"), cwd=ROOT)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "[rank 0] ready"
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=30)[0]
    assert proc.returncode == 128 + signal.SIGTERM
    assert time.monotonic() - start < 10
    assert "PYEP_RANK_EXIT rank=0 code=-15" in rest


def test_guard_stops_its_command_when_stdin_closes(tmp_path) -> None:
    pid_file = tmp_path / "pid"
    child = f"import os,time; open({str(pid_file)!r},'w').write(str(os.getpid())); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-m", "pyep.launch.guard", "--grace", "5", "--", sys.executable,
                             "-c", child], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=ROOT)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "guarded command never started"
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    assert proc.stdin is not None
    proc.stdin.close()          # what ssh does when the launcher goes away
    proc.wait(timeout=30)
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "connection to the launcher closed" in err
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_guard_checks_gpu_count() -> None:
    out = subprocess.run([sys.executable, "-m", "pyep.launch.guard", "--expect-gpus", "64", "--", "true"],
                         capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "the config asks for 64" in out.stderr


_PLAIN = re.compile(r"pyep launch: progress (\d+)/(\d+) \((\d+)%, ([^,]+), (\d+\.\d) s\)(?: (.*))?$")


def _plain_lines(text: str) -> List[Tuple[int, int, str, str]]:
    """(done, total, ranks words, label) of every plain progress line."""
    out = []
    for line in text.splitlines():
        m = _PLAIN.match(line)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), m.group(4), m.group(6) or ""))
    return out


def test_plain_progress_display() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=200)
    with LaunchDisplay(console, ["a", "b"]) as d:
        d.on_line(1, "hello")
        for i in range(1, 11):
            d.on_progress(0, 0, Progress(i, 10, f"step {i}"))
        d.on_progress(1, 1, Progress(3, 10, "other"))
    text = buf.getvalue()
    assert "[b] hello" in text
    lines = _plain_lines(text)
    assert (10, 10, "1 rank", "step 10") in lines
    assert lines[-1] == (3, 10, "2 ranks", "other")      # the slowest rank; the last state is always shown


def test_progress_counts_the_job_steps_of_the_slowest_rank() -> None:
    # The reference demo on 4 ranks: 5 steps each, reported in the interleaved order ranks really
    # report in. Summing over ranks showed 1/5, then 7/20 ... and "dispatch/combine 2/4" twice.
    labels = ["all_reduce"] + [f"dispatch/combine {i}/4" for i in range(1, 5)]
    order = [0, 0, 1, 2, 3, 1, 0, 2, 3, 3, 2, 1, 1, 0, 2, 3, 0, 1, 2, 3]
    seen = {r: 0 for r in range(4)}
    buf = io.StringIO()
    with LaunchDisplay(Console(file=buf, width=200), ["localhost"], ranks=4) as d:
        for r in order:
            seen[r] += 1
            d.on_progress(0, r, Progress(seen[r], 5, labels[seen[r] - 1]))
    lines = _plain_lines(buf.getvalue())
    assert lines, buf.getvalue()
    assert {total for _, total, _, _ in lines} == {5}                      # the total never jumps
    counts = [done for done, _, _, _ in lines]
    assert counts == sorted(set(counts))                                   # each count once, rising
    assert [label for _, _, _, label in lines] == [labels[c - 1] for c in counts]   # label fits the count
    assert lines[-1] == (5, 5, "4 ranks", "dispatch/combine 4/4")


def test_progress_waits_for_ranks_that_have_not_reported() -> None:
    d = LaunchDisplay(Console(file=io.StringIO()), ["localhost"], ranks=3)
    d.on_progress(0, 0, Progress(4, 8, "fast"))
    d.on_progress(0, 1, Progress(2, 8, "slow"))
    job, reporting, expected = d.job_progress()
    assert (job.done, job.total, reporting, expected) == (0, 8, 2, 3)
    d.on_progress(0, 2, Progress(3, 8, "middle"))
    job, reporting, expected = d.job_progress()
    assert (job.done, job.total, job.label, reporting, expected) == (2, 8, "slow", 3, 3)


def test_terminal_progress_bar_renders() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=True)
    with LaunchDisplay(console, ["a"]) as d:
        d.on_progress(0, 0, Progress(2, 4, "half way"))
        d.on_line(0, "a line")
    text = buf.getvalue()
    assert "2/4" in text and "half way" in text and "a line" in text


def test_summary_marks_missing_reports(tmp_path) -> None:
    from pyep.launch.rank import RankExit
    result = SuperviseResult(1, "node 1 (b) exited with status 1",
                             [NodeOutcome(0, "a", -15, 2.0, True), NodeOutcome(1, "b", 1, 1.5)],
                             {0: RankExit(0, -15, 1.0), 2: RankExit(2, 3, 1.2)}, 2.5)
    rows = rank_rows(result, [2, 2], static=True)
    assert [(r.rank, r.node, r.code) for r in rows] == [(0, 0, -15), (1, 0, None), (2, 1, 3), (3, 1, None)]
    buf = io.StringIO()
    render_summary(Console(file=buf, width=200), result, ["a", "b"], rows, [("x.json", 5)], str(tmp_path))
    text = buf.getvalue()
    assert "killed (signal 15)" in text and "no report" in text and "exit 3" in text
    assert "torn down by launcher" in text and "x.json" in text and "FAILED" in text


def test_run_dir_helpers(tmp_path) -> None:
    first = rundir.choose_run_dir(str(tmp_path), "job", now=0)
    rundir.create(first)
    second = rundir.choose_run_dir(str(tmp_path), "job", now=0)
    assert second == first + "-2"
    for rel in ("config.yaml", "summary.json", "logs/rank-00000.log", "bench.json", "plots/lat.png", "notes.bin"):
        path = os.path.join(first, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").write("x")
    assert [f for f, _ in rundir.result_files(first)] == ["bench.json", "plots/lat.png"]


def test_extract_tar_refuses_escapes(tmp_path) -> None:
    def tar_of(name: str) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
        return buf.getvalue()
    assert rundir.extract_tar(tar_of("./logs/a.log"), str(tmp_path / "ok")) == 1
    assert (tmp_path / "ok" / "logs" / "a.log").read_text() == "hi"
    with pytest.raises(ValueError, match="outside"):
        rundir.extract_tar(tar_of("../../evil"), str(tmp_path / "bad"))


def test_pytest_plugin_reports_progress(tmp_path) -> None:
    (tmp_path / "test_tiny.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n\ndef test_c():\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "pyep.launch.pytest_progress", "-p",
                          "no:cacheprovider", "-k", "not test_c", str(tmp_path / "test_tiny.py")],
                         capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PYEP_PROGRESS")]
    assert lines[0] == "PYEP_PROGRESS 0/2 collected"
    assert lines[-1].startswith("PYEP_PROGRESS 2/2 ")


def test_summary_keeps_the_run_directory_on_one_line(tmp_path) -> None:
    # A log or pipe gives rich 80 columns; a wrapped path cannot be copied from the terminal.
    run_dir = str(tmp_path / ("run-" + "x" * 90))
    result = SuperviseResult(0, "all nodes finished", [NodeOutcome(0, "a", 0, 1.0)], {}, 1.0)
    buf = io.StringIO()
    render_summary(Console(file=buf, width=80), result, ["a"], [], [], run_dir)
    assert any(line.endswith("run directory: " + run_dir) for line in buf.getvalue().splitlines())
