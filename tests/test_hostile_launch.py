"""Hostile inputs around the launcher's secrets and environment (issue 22, items 1 and 4): the config's
`env:` values and the job secret never land in files others can read nor on a command line; a planted
link, a malformed stdin line or a missing secret is refused with a typed error; the job store listens
on one interface. Each case asserts the typed error or the documented behaviour, then a correct round
trip."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import subprocess
import sys
from typing import Any, Dict, List

import pytest
from rich.console import Console

from pyep.config import HostFacts, load_config, parse_config
from pyep.config.validate import resolve
from pyep.ep.records import SECRET_FILE_VAR, read_secret_file
from pyep.launch import rundir
from pyep.launch.guard import parse_stdin_payload, read_first_line, stdin_payload
from pyep.launch.plan import build_plan, collect_argv
from pyep.launch.secret import create_job_secret, remove_secret_dir, secret_path, write_private

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
GPU_BOX = HostFacts(gpus=8, names=frozenset({"localhost", "127.0.0.1"}), cwd="/work/here")
TOKEN = "s3cr3t-token-value"
pytestmark = pytest.mark.timeout(240)


def _mode(path: Any) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _ssh_cfg() -> Any:
    text = f"""\
name: ssh-secret
nodes:
  - {{host: node-a, gpus: 2}}
  - {{host: node-b, gpus: 2}}
rendezvous: {{master_addr: node-a, master_port: 29500}}
launcher: {{kind: ssh, ssh: {{workdir: /opt/pyep, python: /opt/venv/bin/python}}}}
env: {{API_TOKEN: "{TOKEN}"}}
ep: {{num_experts: 8}}
workload: {{script: job.py}}
"""
    cfg, locs = parse_config(text, "ssh.yaml")
    return resolve(cfg, locs, GPU_BOX)


# ---------------------------------------------------------------------------------------- files
@pytest.mark.parametrize("name", ["config.yaml", "launch.json"])
def test_files_holding_env_values_are_0600(tmp_path: Any, name: str) -> None:
    """The measured finding: `env:` values landed in 0644 files. Even under umask 0, and over a file
    that was there before with mode 0644, both are 0600; and they still load."""
    cfg = _ssh_cfg()
    (tmp_path / name).write_text("old")
    (tmp_path / name).chmod(0o644)
    old = os.umask(0)
    try:
        rundir.write_launch_files(str(tmp_path), cfg, [{"env": {"API_TOKEN": TOKEN}}], "ssh.yaml")
    finally:
        os.umask(old)
    assert _mode(tmp_path / name) == 0o600 and TOKEN in (tmp_path / name).read_text()
    if name == "config.yaml":
        again = load_config(str(tmp_path / name), facts=GPU_BOX)
        assert again.env["API_TOKEN"] == TOKEN
    else:
        assert json.loads((tmp_path / name).read_text())["commands"][0]["env"]["API_TOKEN"] == TOKEN


def test_private_file_never_follows_a_planted_link(tmp_path: Any) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    (tmp_path / "launch.json").symlink_to(target)
    with pytest.raises(OSError):
        write_private(str(tmp_path / "launch.json"), b"{}")
    assert target.read_text() == "untouched"
    write_private(str(tmp_path / "real.json"), b"{}")
    assert _mode(tmp_path / "real.json") == 0o600 and (tmp_path / "real.json").read_bytes() == b"{}"


def test_job_secret_file_is_private(tmp_path: Any) -> None:
    old = os.umask(0)
    try:
        path = create_job_secret(str(tmp_path))
    finally:
        os.umask(old)
    assert path == secret_path(str(tmp_path))
    assert _mode(os.path.dirname(path)) == 0o700 and _mode(path) == 0o600
    secret = read_secret_file(path)
    (tmp_path / "other").mkdir()
    assert len(secret) == 32 and secret != read_secret_file(create_job_secret(str(tmp_path / "other")))
    remove_secret_dir(path)
    assert not os.path.exists(os.path.dirname(path)) and os.path.isdir(tmp_path)


def test_planted_private_directory_is_refused(tmp_path: Any) -> None:
    """A `private` link planted in the run directory: the secret is not written through it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "private").symlink_to(elsewhere)
    with pytest.raises(FileExistsError):
        create_job_secret(str(run))
    assert list(elsewhere.iterdir()) == []
    (run / "private").unlink()
    assert read_secret_file(create_job_secret(str(run)))


# ---------------------------------------------------------------------------------------- ssh
def test_ssh_command_line_holds_no_env_value_and_no_secret() -> None:
    plan = build_plan(_ssh_cfg(), "runs/s", GPU_BOX, parent_env={})
    for cmd in plan.commands:
        assert not any(TOKEN in a for a in cmd.argv), cmd.argv
        assert cmd.env["API_TOKEN"] == TOKEN and SECRET_FILE_VAR not in cmd.env
        assert "--env-stdin" in cmd.argv[-1]
        env, secret = parse_stdin_payload(stdin_payload(cmd.env, b"k" * 32).rstrip(b"\n"))
        assert env == cmd.env and secret == b"k" * 32
    # The copy of a node's run directory never brings back the secret of a shared one.
    assert "--exclude=./private" in collect_argv(plan.config, "node-a", plan.remote_run_dir)[-1]


MALFORMED_STDIN = {
    "not-json": (b"env API_TOKEN=x", "not a JSON document"),
    "not-utf8": (b"\xff\xfe{}", "not a JSON document"),
    "nested": (b"[" * 100_000, "not a JSON document"),
    "no-env": (b'{"job_secret": null}', "no 'env' object"),
    "env-list": (b'{"env": ["A=1"]}', "no 'env' object"),
    "bad-name": (b'{"env": {"A B": "1"}}', "'A B' is not NAME=string"),
    "non-string-value": (b'{"env": {"A": 1}}', "'A' is not NAME=string"),
    "nul-in-value": (b'{"env": {"A": "x\\u0000y"}}', "'A' is not NAME=string"),
    "secret-not-hex": (b'{"env": {}, "job_secret": "zz"}', "not a hex string"),
    "secret-number": (b'{"env": {}, "job_secret": 5}', "not a hex string"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_STDIN))
def test_guard_stdin_line_malformed(case: str) -> None:
    line, why = MALFORMED_STDIN[case]
    with pytest.raises(ValueError, match=why):
        parse_stdin_payload(line)
    assert parse_stdin_payload(b'{"env": {"A": "1"}, "job_secret": "00ff"}') == ({"A": "1"}, b"\x00\xff")


def _pipe_with(data: bytes, close: bool) -> int:
    r, w = os.pipe()
    os.write(w, data)
    if close:
        os.close(w)
    return r


def test_guard_stdin_line_bounded_in_size_and_time() -> None:
    with pytest.raises(ValueError, match="longer than 16 bytes"):
        read_first_line(_pipe_with(b"x" * 64, False), 5.0, limit=16)
    with pytest.raises(ValueError, match="stdin closed"):
        read_first_line(_pipe_with(b'{"env"', True), 5.0)
    with pytest.raises(ValueError, match="within 0.2 s"):
        read_first_line(_pipe_with(b"", False), 0.2)
    assert read_first_line(_pipe_with(b'{"env": {}}\nrest', False), 5.0) == b'{"env": {}}'


def test_guard_refuses_a_bad_line_before_starting_anything(tmp_path: Any) -> None:
    marker = tmp_path / "started"
    argv = [sys.executable, "-m", "pyep.launch.guard", "--env-stdin", "--", sys.executable, "-c",
            f"open({str(marker)!r}, 'w')"]
    bad = subprocess.run(argv, input=b"API_TOKEN=x\n", capture_output=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and b"not a JSON document" in bad.stderr and not marker.exists()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdin is not None
    proc.stdin.write(stdin_payload({"A": "1"}, None))
    proc.stdin.flush()
    try:
        assert proc.wait(60) == 0 and marker.exists()
    finally:
        proc.stdin.close()
        if proc.poll() is None:
            proc.kill()


# ---------------------------------------------------------------------------------------- the job store
def _listen_addresses(port: int) -> List[str]:
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                found.append(addr)
    return found


def test_job_store_listens_on_one_interface() -> None:
    """c10d's TCPStore server binds every interface; the launcher's and the drill's store serve on a
    socket bound to 127.0.0.1 only."""
    import datetime

    import torch.distributed as dist

    from pyep.launch.store import JobStore
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp here")
    default = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=10))
    assert all(a.strip("0") == "" for a in _listen_addresses(default.port))      # 0.0.0.0 / [::]: everyone
    job = JobStore("127.0.0.1", 0, 1, 10.0)
    try:
        assert _listen_addresses(job.port) == ["0100007F"]                         # 127.0.0.1 only
        client = dist.TCPStore("127.0.0.1", job.port, 1, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=10))
        client.set("k", b"v")
        assert job.store.get("k") == b"v"
    finally:
        job.close()


# ---------------------------------------------------------------------------------------- launches
SECRET_CHECK = """\
import hashlib, json, os, pathlib, stat
rank = int(os.environ["RANK"])
path = os.environ["PYEP_JOB_SECRET_FILE"]
hexed = open(path).read().strip()
cmdlines, pid = [], os.getpid()
while pid > 1:
    try:
        cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"))
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        break
from pyep.ep.records import resolve_job_secret
out = {"sha": hashlib.sha256(hexed.encode()).hexdigest(), "mode": stat.S_IMODE(os.stat(path).st_mode),
       "dir_mode": stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode), "path": path,
       "resolves": resolve_job_secret(None).hex() == hexed, "token": os.environ.get("API_TOKEN"),
       "in_cmdline": any(hexed in c or "s3cr3t" in c for c in cmdlines), "ancestors": len(cmdlines)}
(pathlib.Path(os.environ["PYEP_RUN_DIR"]) / f"secret-{rank}.json").write_text(json.dumps(out))
"""


def _launch(cfg: Any, run_dir: str) -> int:
    from pyep.launch.runner import LaunchOptions, launch
    return launch(cfg, LaunchOptions(run_dir=run_dir, source="t.yaml"), HostFacts(gpus=0, cwd=ROOT),
                  Console(file=io.StringIO(), width=200))


@pytest.mark.parametrize("policy", ["none", "rank"])
def test_local_launch_hands_the_secret_by_private_file(tmp_path: Any, policy: str) -> None:
    """Every rank of a job reads the same fresh secret from a 0600 file in a 0700 directory; neither it
    nor an env value is on any command line of the rank's process or its ancestors; launch.json and
    config.yaml are 0600 and hold the env value but not the secret; the secret is gone after the job."""
    script = tmp_path / "check.py"
    script.write_text(SECRET_CHECK)
    text = (f"name: secret\nnodes:\n  - {{host: localhost, gpus: 0, procs: 2}}\n"
            f"rendezvous: {{master_addr: 127.0.0.1, master_port: 0}}\n"
            f"launcher: {{kind: local, grace_s: 5, timeout_s: 120, restart: {{policy: {policy}}}}}\n"
            f"env: {{API_TOKEN: {TOKEN}}}\nep: {{backend: reference, dist_backend: gloo, num_experts: 8}}\n"
            f"workload: {{script: {script}}}\n")
    cfg, locs = parse_config(text, "t.yaml")
    cfg = resolve(cfg, locs, HostFacts(gpus=0, cwd=ROOT))
    run_dir = tmp_path / "run"
    assert _launch(cfg, str(run_dir)) == 0
    res = [json.loads((run_dir / f"secret-{r}.json").read_text()) for r in range(2)]
    assert res[0]["sha"] == res[1]["sha"] and all(r["resolves"] for r in res)
    assert all(r["mode"] == 0o600 and r["dir_mode"] == 0o700 and r["token"] == TOKEN for r in res)
    assert not any(r["in_cmdline"] for r in res) and all(r["ancestors"] >= 2 for r in res)
    assert res[0]["path"] == secret_path(str(run_dir)) and not (run_dir / "private").exists()
    for name in ("launch.json", "config.yaml"):
        assert _mode(run_dir / name) == 0o600
        text = (run_dir / name).read_text()
        hexes = re.findall(r"[0-9a-f]{64}", text)
        assert res[0]["sha"] not in {hashlib.sha256(h.encode()).hexdigest() for h in hexes}
    assert TOKEN in (run_dir / "launch.json").read_text()


def test_slurm_run_directory_secret_and_files(tmp_path: Any) -> None:
    from pyep.launch import slurm
    from pyep.launch.runner import LaunchOptions, launch
    cfg = load_config(os.path.join(CONFIGS, "four_nodes.yaml"), [f"launcher.slurm.workdir={tmp_path}"],
                      facts=GPU_BOX)
    run = tmp_path / "runs" / "r"
    assert launch(cfg, LaunchOptions(run_dir=str(run), source="four.yaml"), GPU_BOX,
                  Console(file=io.StringIO(), width=200)) == 0
    assert _mode(run / "private") == 0o700 and _mode(run / "private" / "job.secret") == 0o600
    assert _mode(run / "config.yaml") == 0o600 and _mode(run / "launch.json") == 0o600
    assert read_secret_file(str(run / "private" / "job.secret"))
    node = {"SLURMD_NODENAME": cfg.nodes[1].host, "SLURM_NODEID": "1", slurm.MASTER_VAR: "gpu-node-0"}
    argv, extra = slurm.node_command(cfg, node, str(run))
    assert extra[SECRET_FILE_VAR] == str(run / "private" / "job.secret")
    assert not any("job.secret" in a for a in argv) and "private" not in slurm.sbatch_script(
        cfg, str(run / "config.yaml"), str(run), "four.yaml")


def test_drill_gives_its_ranks_the_secret_by_environment_and_removes_it(monkeypatch: Any) -> None:
    """pyep drill: the secret file's path goes in each rank's environment, never in its argv; the
    temporary directory is removed when the drill ends, even when a rank cannot be started."""
    from pyep.launch import drill
    seen: Dict[str, Any] = {}

    def fake_spawn(args: Dict[str, Any], secret_file: str) -> Any:
        seen["secret_file"] = secret_file
        seen["secret"] = read_secret_file(secret_file)
        seen["parent_mode"] = _mode(os.path.dirname(os.path.dirname(secret_file)))
        raise OSError("cannot start a rank here")
    monkeypatch.setattr(drill, "_spawn", fake_spawn)
    out = drill.run_drill(drill.DrillConfig(backend="reference", world=2, rounds_after=1), 0, "between")
    assert not out.ok and "cannot start a rank here" in out.why
    assert len(seen["secret"]) == 32 and seen["parent_mode"] == 0o700
    assert not os.path.exists(os.path.dirname(os.path.dirname(seen["secret_file"])))

    captured: Dict[str, Any] = {}

    class FakePopen:
        def __init__(self, argv: List[str], env: Dict[str, str], **_: Any) -> None:
            captured.update(argv=argv, env=env)
    monkeypatch.undo()          # the real _spawn, with a Popen that only records what it was given
    monkeypatch.setattr(drill.subprocess, "Popen", FakePopen)
    drill._spawn({"rank": 0}, "/tmp/x/private/job.secret")
    assert captured["env"][SECRET_FILE_VAR] == "/tmp/x/private/job.secret"
    assert not any("job.secret" in a for a in captured["argv"])
