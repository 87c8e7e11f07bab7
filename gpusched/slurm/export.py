"""Write a node's Slurm configuration from the live inventory: the files `gpusched slurm export`
and `gpusched slurm relayout` produce, and the hook scripts Slurm runs.

Everything written lands in OUT; with `gres_conf` / `slurm_conf` set, the node's managed block in
those shared files is replaced too, so one cluster-wide gres.conf and slurm.conf can hold every
node. The options are saved as OUT/export.json so relayout regenerates exactly the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from gpusched.protocol import GpusResult
from gpusched.slurm import devfiles, gresconf

HOOKS = ("prolog", "task-prolog", "epilog")
OPTIONS_FILE = "export.json"


@dataclass(frozen=True)
class ExportOptions:
    node: str
    out: str
    socket: str | None = None  # the daemon the CLI talked to (relayout talks to it again)
    dev_root: str = "/dev"
    mknod: bool = False
    node_params: str = ""
    gres_conf: str | None = None  # shared gres.conf whose block for `node` is replaced
    slurm_conf: str | None = None  # shared slurm.conf (or an included file) whose NodeName block is replaced
    run_dir: str = "/run/gpusched-slurm"
    job_mapping_dir: str | None = None
    mps_control: str = "nvidia-cuda-mps-control"
    gres_mps: bool = False  # offer share = "mps" GPUs as gres/mps too (see gresconf.mps_skipped)
    gres_shards: int = 0  # offer share = "mps" GPUs as this many gres/shard each


def load_options(out: str) -> ExportOptions:
    path = Path(out) / OPTIONS_FILE
    try:
        return ExportOptions(**json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise ValueError(f"{path} not found: run `gpusched slurm export --out {out}` first") from None
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not written by this gpusched: {exc}") from None


def hook_script(kind: str, opts: ExportOptions) -> str:
    """A shell script Slurm can run (Prolog= takes a program, not a command line). The TaskProlog
    runs as the job's user for every task: it only prints what the Prolog prepared (hooks.py)."""
    if kind == "task-prolog":
        env_dir = shlex.quote(str(Path(opts.run_dir) / "jobs"))
        return (f"#!/bin/sh\n# Slurm TaskProlog for node {opts.node}, written by `gpusched slurm export`.\n"
                f"case \"$SLURM_JOB_ID\" in ''|*[!0-9]*) exit 0;; esac\n"
                f"cat {env_dir}/\"$SLURM_JOB_ID\".env 2>/dev/null\nexit 0\n")
    argv = [sys.executable, "-I", "-m", "gpusched_cli.main", "slurm", "hook", kind,
            "--map", str(Path(opts.out) / "gres-map.json"), "--run-dir", opts.run_dir,
            "--mps-control", opts.mps_control]
    if opts.job_mapping_dir is not None:
        argv += ["--job-mapping-dir", opts.job_mapping_dir]
    return (f"#!/bin/sh\n# Slurm {kind} for node {opts.node}, written by `gpusched slurm export`.\n"
            f"exec {shlex.join(argv)}\n")


def write_export(result: GpusResult, opts: ExportOptions) -> list[gresconf.GresDevice]:
    """Write everything for `opts.node`; returns its devices. Raises ValueError/OSError with the path."""
    devs = gresconf.devices(result, opts.dev_root, opts.gres_mps, opts.gres_shards)
    if opts.mknod:
        devfiles.make_device_files(devs, opts.dev_root)
    out = Path(opts.out)
    (out / "hooks").mkdir(parents=True, exist_ok=True)
    gres_text = gresconf.gres_conf(opts.node, devs)
    node_text = gresconf.node_line(opts.node, devs, opts.node_params)
    _write(out / "gres.conf", gres_text)
    _write(out / "slurm-node.conf", node_text)
    _write(out / "gres-map.json", gresconf.gres_map(opts.node, devs))
    _write(out / "billing.txt", f"TRESBillingWeights={gresconf.billing_weights(result)}\n")
    for kind in HOOKS:
        _write(out / "hooks" / kind, hook_script(kind, opts), mode=0o755)
    _write(out / OPTIONS_FILE, json.dumps(asdict(opts), indent=2) + "\n")
    if opts.gres_conf is not None:
        _update_block(opts.gres_conf, opts.node, gres_text)
    if opts.slurm_conf is not None:
        _update_block(opts.slurm_conf, opts.node, node_text)
    return devs


def _update_block(path: str, node: str, body: str) -> None:
    """Rewrite `node`'s block of a file the nodes share: under an exclusive lock beside it, so two
    nodes exporting at once do not each write back the file without the other's block."""
    target = Path(path)
    with open(target.with_name(f".{target.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            text = target.read_text(encoding="utf-8")
        except FileNotFoundError:
            text = ""
        _write(target, gresconf.replace_block(text, node, body))


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    """Atomic replace: slurmd may read the file at any moment (a temporary name of this writer's own)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
