"""`pyep launch` end to end: plan, run directory, supervised run, summary (or dry run / sbatch)."""
from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import subprocess
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from rich.console import Console

from ..config import ClusterConfig, HostFacts
from . import rundir, slurm
from .display import LaunchDisplay, rank_rows, render_summary
from ..ep.records import new_job_secret
from .plan import STORE_ADDR, LaunchPlan, build_plan, collect_argv
from .secret import create_job_secret, remove_secret_dir
from .store import JobStore
from .supervisor import RestartPolicy, SuperviseResult, Supervisor

log = logging.getLogger("pyep.launch")

_COLLECT_TIMEOUT_S = 300.0


@dataclass
class LaunchOptions:
    dry_run: bool = False
    submit: bool = False        # slurm: run sbatch on the generated script
    quiet: bool = False         # no streamed rank output, only progress, status and summary
    run_dir: Optional[str] = None
    source: str = "<config>"


def _describe(cfg: ClusterConfig, plan_nproc: int) -> str:
    virt = cfg.ep.gpus_per_virtual_node
    return (f"{cfg.name}: {cfg.launcher.kind} launcher, {len(cfg.nodes)} node(s) x {plan_nproc} rank(s)"
            + (f", virtual nodes of {virt}" if virt else ""))


def _commands_json(plan: LaunchPlan) -> List[Dict[str, Any]]:
    return [{"node": c.index, "host": c.host, "argv": c.argv, "env": c.env, "cwd": c.cwd, "remote": c.remote,
             "nproc": c.nproc, "first_rank": c.first_rank} for c in plan.commands]


def _collect(plan: LaunchPlan, console: Console) -> None:
    for cmd in plan.commands:
        dest = os.path.join(plan.run_dir, "nodes", f"{cmd.index}-{cmd.host}")
        try:
            out = subprocess.run(collect_argv(plan.config, cmd.host, plan.remote_run_dir), capture_output=True,
                                 timeout=_COLLECT_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
            if out.returncode != 0:
                raise RuntimeError(out.stderr.decode(errors="replace").strip() or f"exit {out.returncode}")
            n = rundir.extract_tar(out.stdout, dest)
            console.print(f"pyep launch: collected {n} file(s) from {cmd.host} into {dest}", markup=False)
        except subprocess.TimeoutExpired:
            console.print(f"pyep launch: copying results from {cmd.host} took over {_COLLECT_TIMEOUT_S:.0f} s; "
                          "skipped", markup=False, style="yellow")
        except (RuntimeError, ValueError, OSError) as exc:
            console.print(f"pyep launch: could not collect results from {cmd.host}: {exc}", markup=False,
                          style="yellow")


def run_plan(plan: LaunchPlan, console: Console, opts: LaunchOptions) -> SuperviseResult:
    rundir.create(plan.run_dir)
    # One fresh secret per job (pyep.ep.records): local ranks read it from <run dir>/private, ssh nodes
    # get it on stdin; it is removed when the job ends.
    job_secret = new_job_secret()
    secret_file = create_job_secret(plan.run_dir, job_secret)
    try:
        return _run_plan(plan, console, opts, job_secret)
    finally:
        remove_secret_dir(secret_file)


def _run_plan(plan: LaunchPlan, console: Console, opts: LaunchOptions, job_secret: bytes) -> SuperviseResult:
    cfg = plan.config
    rundir.write_launch_files(plan.run_dir, cfg, _commands_json(plan), opts.source)
    hosts = [c.host if sum(1 for d in plan.commands if d.host == c.host) == 1 else f"{c.host}#{c.index}"
             for c in plan.commands]
    console.print(f"pyep launch: {_describe(cfg, plan.commands[0].nproc)}; run directory {plan.run_dir}",
                  markup=False, highlight=False, soft_wrap=True)    # one line: the path stays copyable
    restart = None
    store = None
    if cfg.launcher.restart.policy == "rank":
        # The job's store lives here, not in a rank: it must outlive any single rank. It listens on the
        # ranks' address only (docs/elastic.md, "Threat model").
        store = JobStore(STORE_ADDR, plan.master_port, plan.total_ranks, cfg.launcher.timeout_s)
        restart = RestartPolicy(cfg.launcher.restart.max_restarts, cfg.launcher.restart.delay_s, plan.run_dir)
        console.print(f"pyep launch: single-rank restarts (at most {restart.max_restarts} per rank); job store on "
                      f"{STORE_ADDR}:{plan.master_port}", markup=False, highlight=False)
    try:
        with LaunchDisplay(console, hosts, quiet=opts.quiet, ranks=plan.total_ranks) as display:
            sup = Supervisor(plan.commands, display, timeout_s=cfg.launcher.timeout_s, grace_s=cfg.launcher.grace_s,
                             log_dir=os.path.join(plan.run_dir, "logs"), restart=restart, job_secret=job_secret)
            result = sup.run()
    finally:
        if store is not None:
            store.close()
    if cfg.launcher.kind == "ssh" and cfg.launcher.ssh.collect_results:
        _collect(plan, console)
    static = cfg.rendezvous.endpoint is None
    rows = rank_rows(result, [c.nproc for c in plan.commands], static)
    results = rundir.result_files(plan.run_dir)
    render_summary(console, result, hosts, rows, results, plan.run_dir)
    rundir.write_summary(plan.run_dir, {
        "exit_code": result.exit_code, "reason": result.reason, "seconds": result.seconds,
        "nodes": [dataclasses.asdict(n) for n in result.nodes],
        "ranks": [dataclasses.asdict(r) for r in rows],
        "results": [{"file": f, "bytes": b} for f, b in results],
        "events": sup.events,
    })
    return result


def launch(cfg: ClusterConfig, opts: LaunchOptions, facts: HostFacts, console: Optional[Console] = None) -> int:
    """Run (or print) a resolved config's launch; returns the process exit status."""
    console = console or Console()
    run_rel = opts.run_dir or rundir.choose_run_dir(cfg.launcher.run_root, cfg.name)
    if cfg.launcher.kind == "slurm":
        return _slurm(cfg, opts, facts, console, run_rel)
    plan = build_plan(cfg, run_rel, facts)
    if opts.dry_run:
        print(f"# {_describe(cfg, plan.commands[0].nproc)}")
        print(f"# run directory: {plan.run_dir}" + (f" (on the nodes: {plan.remote_run_dir})"
                                                    if plan.remote_run_dir != plan.run_dir else ""))
        for cmd in plan.commands:
            print(f"# node {cmd.index} ({cmd.host})")
            print(cmd.shell_line())
            if cmd.remote:
                print("# sent on the connection's stdin with the job secret (never on the command line): "
                      + shlex.join(["env", *[f"{k}={v}" for k, v in cmd.env.items()]]))
        return 0
    return run_plan(plan, console, opts).exit_code


def _slurm(cfg: ClusterConfig, opts: LaunchOptions, facts: HostFacts, console: Console, run_rel: str) -> int:
    workdir = str(cfg.launcher.slurm.workdir)
    local_dir = run_rel if os.path.isabs(run_rel) else os.path.join(facts.cwd, run_rel)
    node_dir = run_rel if os.path.isabs(run_rel) else os.path.normpath(os.path.join(workdir, run_rel))
    config_path = os.path.join(node_dir, "config.yaml")
    script = slurm.sbatch_script(cfg, config_path, node_dir, opts.source)
    if opts.dry_run:
        print(f"# {_describe(cfg, cfg.nodes[0].procs or 0)}")
        print(f"# sbatch script ({os.path.join(local_dir, 'job.sbatch')}):")
        print(script, end="")
        print("# each node then runs:")
        for line in slurm.dry_run_lines(cfg, node_dir):
            print(line)
        return 0
    rundir.create(local_dir)
    # The nodes read the secret from the run directory (private/, 0700) as they read the config.
    create_job_secret(local_dir)
    rundir.write_launch_files(local_dir, cfg, [{"sbatch": script}], opts.source)
    path = os.path.join(local_dir, "job.sbatch")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(script)
    if os.path.realpath(local_dir) != os.path.realpath(node_dir):
        console.print(f"pyep launch: the nodes read {node_dir} (launcher.slurm.workdir); copy {local_dir} there "
                      "unless it is the same shared directory", markup=False, style="yellow")
    if not opts.submit:
        console.print(f"pyep launch: wrote {path}; submit it with: sbatch {path}  (or pyep launch --submit)",
                      markup=False, highlight=False)
        return 0
    try:
        job = slurm.submit(path)
    except RuntimeError as exc:
        console.print(f"pyep launch: {exc}", markup=False, style="bold red")
        return 1
    console.print(f"pyep launch: submitted Slurm job {job}; output: {node_dir}/slurm-{job}.out", markup=False,
                  highlight=False)
    return 0
