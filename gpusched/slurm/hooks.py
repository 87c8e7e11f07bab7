"""Slurm's Prolog, TaskProlog and Epilog for a gpusched node.

Slurm picks the GRES indices; these hooks turn them into what a CUDA program needs: the device
UUIDs in CUDA_VISIBLE_DEVICES (a MIG slice is only reachable by its UUID), a per-user MPS control
daemon for jobs on GPUs shared through MPS (gres/mps or not), and dcgm-exporter's job-mapping files.

A failing Prolog drains the node and requeues the job in Slurm, so the Prolog never fails: a
problem (an index missing from the map, MPS refusing to start) is written into the job's record,
and the TaskProlog, which runs inside the job, prints it to the job's output and hides every GPU
rather than let the job run on the wrong one. The Epilog always succeeds for the same reason.

The Prolog runs as root; it leaves RUN_DIR/jobs/ID.json (its record, for the Epilog) and ID.env
(the TaskProlog's output, made in advance), root's and readable by all: they hold UUIDs only. The
TaskProlog, running as the job's user, only prints ID.env.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gpusched.indexlist import parse_index_list
from gpusched.slurm.gresconf import GresDevice, load_map

_JOB_ID = re.compile(r"^[0-9]+$")


@dataclass(frozen=True)
class HookConfig:
    map_path: str  # gres-map.json written by `gpusched slurm export`
    run_dir: str  # job records and MPS pipe directories
    job_mapping_dir: str | None = None  # dcgm-exporter --hpc-job-mapping-dir
    mps_control: str = "nvidia-cuda-mps-control"


@dataclass
class JobRecord:
    job_id: str
    uid: int
    uuids: list[str] = field(default_factory=list)
    mapping_names: list[str] = field(default_factory=list)  # dcgm job-mapping file names
    mps_device: str | None = None
    mps_pipe: str | None = None
    mps_log: str | None = None
    error: str | None = None  # the job gets no GPU (and is told why)
    warning: str | None = None  # the job is told, and runs on its GPUs all the same


MAX_GRES_INDICES = 1024  # a node's GRES devices (MIG instances included) number in the tens


def parse_indices(text: str) -> list[int]:
    """SLURM_JOB_GPUS: `0,2` or ranges `0-2,5`; ValueError naming the bad part."""
    return parse_index_list(text, "SLURM_JOB_GPUS", MAX_GRES_INDICES)


def wants_mps(chosen: list[GresDevice]) -> bool:
    """Start a per-user MPS control daemon for this job: it runs on a GPU gpusched shares through MPS
    (share = "mps"). That covers gres/mps jobs too: export offers gres/mps only on such GPUs, and
    Slurm 22.05 gives the Prolog nothing but SLURM_JOB_GPUS to tell them apart (seen by hand: no
    variable names the job's GRES), so the GPU is what decides."""
    return any(d.mps for d in chosen)


def _records_dir(cfg: HookConfig) -> Path:
    return Path(cfg.run_dir) / "jobs"


@contextlib.contextmanager
def _locked(cfg: HookConfig) -> Iterator[None]:
    """Prologs and epilogs of concurrent jobs on one node change shared state (MPS daemons, mapping
    files): one at a time."""
    os.makedirs(cfg.run_dir, mode=0o755, exist_ok=True)
    with open(os.path.join(cfg.run_dir, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _mapping_name(dev: GresDevice) -> str:
    return str(dev.gpu_index) if dev.gi_id is None else f"{dev.gpu_index}.{dev.gi_id}"


def _read_mapping(directory: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if re.match(r"^[0-9]+(\.[0-9]+)?$", name):
                with contextlib.suppress(OSError, ValueError):
                    out[name] = [int(x) for x in Path(directory, name).read_text().split()]
    return out


def _update_mapping(cfg: HookConfig, names: list[str], job_id: int, add: bool) -> None:
    from gpusched.daemon.jobmap import write_job_mapping  # one writer for the file format

    if cfg.job_mapping_dir is None:
        return
    mapping = _read_mapping(cfg.job_mapping_dir)
    for name in names:
        ids = set(mapping.get(name, []))
        ids = ids | {job_id} if add else ids - {job_id}
        mapping[name] = sorted(ids)
    write_job_mapping(cfg.job_mapping_dir, {k: v for k, v in mapping.items() if v})


def _mps_daemon(cfg: HookConfig, device: str, uid: int) -> Any:
    from gpusched.gpu.mps import MpsDaemon  # only MPS jobs need it

    return MpsDaemon(device, Path(cfg.run_dir) / "mps", uid=uid, control_binary=cfg.mps_control)


def prolog(cfg: HookConfig, env: Mapping[str, str]) -> JobRecord:
    """Resolve the job's GPUs to UUIDs, start MPS if asked, record it all; never raises for the job."""
    job_id = env.get("SLURM_JOB_ID", "")
    if not _JOB_ID.match(job_id):
        raise ValueError(f"SLURM_JOB_ID {job_id!r} is not a job id; is this running as Slurm's Prolog?")
    uid_text = env.get("SLURM_JOB_UID", "")
    # (digits only: `--5` or `-7` is no uid, and int() would take "٣" or " 7")
    rec = JobRecord(job_id=job_id, uid=int(uid_text) if uid_text.isascii() and uid_text.isdecimal() else -1)
    with _locked(cfg):
        try:
            if rec.uid == -1:  # (a failing Prolog would drain the node: the job hears instead)
                raise ValueError(f"SLURM_JOB_UID {uid_text!r} is not a uid")
            indices = parse_indices(env.get("SLURM_JOB_GPUS", ""))
            if indices:
                devs = load_map(Path(cfg.map_path).read_text(encoding="utf-8"))
                missing = [i for i in indices if i >= len(devs)]
                if missing:
                    raise ValueError(f"GRES index {missing[0]} is not in {cfg.map_path} ({len(devs)} devices); "
                                     "the node's gres.conf and gpusched's export disagree: run "
                                     "`gpusched slurm export` and restart slurmd")
                chosen = [devs[i] for i in indices]
                rec.uuids = [d.uuid for d in chosen]
                rec.mapping_names = [_mapping_name(d) for d in chosen]
                if wants_mps(chosen):
                    shared = [d for d in chosen if d.mps]
                    if len(shared) > 1:  # one CUDA_MPS_PIPE_DIRECTORY: its daemon would hide the others
                        raise ValueError(f"the job has {len(shared)} GPUs shared through MPS; one job can use "
                                         "one (ask for one GPU, or for exclusive ones)")
                    mps = _mps_daemon(cfg, shared[0].uuid, rec.uid)
                    mps.start()
                    rec.mps_device, rec.mps_pipe, rec.mps_log = shared[0].uuid, str(mps.pipe_dir), str(mps.log_dir)
                try:
                    _update_mapping(cfg, rec.mapping_names, int(job_id), add=True)
                except OSError as exc:  # monitoring loses this job's label; the job keeps its GPUs
                    rec.warning = f"gpusched prolog on {env.get('SLURMD_NODENAME', '?')}: dcgm job mapping: {exc}"
        except Exception as exc:  # the job hears about it (TaskProlog); the node stays in service
            rec.error = f"gpusched prolog on {env.get('SLURMD_NODENAME', '?')}: {exc}"
        _write_record(cfg, rec)
    return rec


def _write_record(cfg: HookConfig, rec: JobRecord) -> None:
    """RUN_DIR/jobs/ID.json (for the Epilog) and ID.env, the TaskProlog's output made in advance."""
    directory = _records_dir(cfg)
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    for suffix, text in (("env", task_prolog_lines(rec)), ("json", json.dumps(rec.__dict__))):
        tmp = directory / f".{rec.job_id}.{suffix}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o644)
        tmp.replace(directory / f"{rec.job_id}.{suffix}")


class BadRecord(Exception):
    """A job's record that cannot be read (truncated, or not one this version can take)."""


_RECORD_FIELDS = frozenset(JobRecord.__dataclass_fields__)


def read_record(cfg: HookConfig, job_id: str) -> JobRecord | None:
    """The job's record; None when it has none; BadRecord when it cannot be read. Keys this version
    does not know are left out (a record written by another version across an upgrade)."""
    if not _JOB_ID.match(job_id):
        return None
    try:
        data = json.loads((_records_dir(cfg) / f"{job_id}.json").read_text(encoding="utf-8"))
        return JobRecord(**{k: v for k, v in data.items() if k in _RECORD_FIELDS})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise BadRecord(f"job {job_id}'s record in {_records_dir(cfg)} cannot be read: {exc}") from None


def task_prolog_lines(rec: JobRecord) -> str:
    """`export NAME=VALUE` / `print MSG` lines, which Slurm applies to the task's environment.

    The Prolog writes them once per job; the TaskProlog (`export` writes it as a two-line shell
    script) only prints the file, so no interpreter starts per task and the job's user needs no
    access to gpusched's installation."""
    if rec.error is not None:
        # One line: Slurm runs every line of this output as a command (export, unset, print).
        message = " ".join(rec.error.split())
        return f"print {message}; no GPU is visible to this job\nexport CUDA_VISIBLE_DEVICES=\n"
    out = f"print {' '.join(rec.warning.split())}\n" if rec.warning is not None else ""
    # (none on this node: set empty, or CUDA would enumerate every GPU, others' slices too)
    out += f"export CUDA_VISIBLE_DEVICES={','.join(rec.uuids)}\n"
    if rec.mps_pipe is not None and rec.mps_log is not None:
        out += f"export CUDA_MPS_PIPE_DIRECTORY={rec.mps_pipe}\nexport CUDA_MPS_LOG_DIRECTORY={rec.mps_log}\n"
    return out


def task_prolog(cfg: HookConfig, env: Mapping[str, str], out: TextIO) -> None:
    """What the TaskProlog prints for this job (nothing for a job with no record: not one of ours)."""
    try:
        rec = read_record(cfg, env.get("SLURM_JOB_ID", ""))
    except BadRecord as exc:
        out.write(f"print gpusched: {' '.join(str(exc).split())}; no GPU is visible to this job\n"
                  "export CUDA_VISIBLE_DEVICES=\n")
        return
    if rec is not None:
        out.write(task_prolog_lines(rec))


def epilog(cfg: HookConfig, env: Mapping[str, str]) -> list[str]:
    """Undo the Prolog: mapping files, the MPS daemon when the user's last job on it ends, the record.
    Returns the problems met (logged by the caller); never raises for them."""
    job_id = env.get("SLURM_JOB_ID", "")
    problems: list[str] = []
    with _locked(cfg):
        try:
            rec = read_record(cfg, job_id)
        except BadRecord as exc:  # nothing of it can be undone: its files go, the node stays in service
            problems.append(str(exc))
            for suffix in ("env", "json"):
                with contextlib.suppress(OSError):
                    (_records_dir(cfg) / f"{job_id}.{suffix}").unlink()
            return problems
        if rec is None:
            return problems
        try:
            _update_mapping(cfg, rec.mapping_names, int(job_id), add=False)
        except OSError as exc:
            problems.append(f"job mapping: {exc}")
        for suffix in ("env", "json"):
            with contextlib.suppress(FileNotFoundError):
                (_records_dir(cfg) / f"{job_id}.{suffix}").unlink()
        if rec.mps_device is not None and not _mps_still_used(cfg, rec):
            try:
                _mps_daemon(cfg, rec.mps_device, rec.uid).stop()
            except Exception as exc:
                problems.append(f"MPS stop: {exc}")
    return problems


def _mps_still_used(cfg: HookConfig, rec: JobRecord) -> bool:
    for path in _records_dir(cfg).glob("*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError):
            other = JobRecord(**{k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items()
                                 if k in _RECORD_FIELDS})
            if other.uid == rec.uid and other.mps_device == rec.mps_device:
                return True
    return False


def run(kind: str, cfg: HookConfig, env: Mapping[str, str]) -> int:
    """Entry for the CLI: the exit status Slurm sees is 0 whenever the node is fine."""
    if kind == "prolog":
        try:
            rec = prolog(cfg, env)
        except ValueError as exc:  # not run by Slurm at all: say so
            print(f"gpusched slurm hook prolog: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # the record cannot be written (a full /run): the job would run unseen
            print(f"gpusched slurm hook prolog: cannot record job {env.get('SLURM_JOB_ID', '?')} in "
                  f"{cfg.run_dir}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        for problem in (rec.error, rec.warning):
            if problem:
                print(problem, file=sys.stderr)
        return 0
    if kind == "task-prolog":
        task_prolog(cfg, env, sys.stdout)
        return 0
    try:
        problems = epilog(cfg, env)
    except OSError as exc:  # (the lock or the run directory): the Epilog still exits 0
        problems = [f"{cfg.run_dir}: {exc.strerror or exc}"]
    for problem in problems:
        print(f"gpusched epilog: {problem}", file=sys.stderr)
    return 0
