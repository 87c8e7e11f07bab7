#!/usr/bin/env python3
"""A simulated `cuda-checkpoint`: the same command line, messages and exit codes as NVIDIA's tool.

The daemon runs it on simulated GPUs (`--sim`) and the tests run it in place of the real program, so
the real wrapper (gpu/checkpoint.py) runs everywhere. Standard library only: it is executed directly
(`#!/usr/bin/env python3`) or as `python -I simcheckpoint.py`, outside the venv.

What it reproduces (sources in docs/gpu.md, "cuda-checkpoint"):
- operations `--get-state`, `--action lock|checkpoint|restore|unlock [--timeout MS]`, `--toggle`,
  `--get-restore-tid`, `--device-map old=new,...` (restore only), `--pid|-p`, `--timeout|-t`, `--help|-h`;
- states running -> (lock) locked -> (checkpoint) checkpointed -> (restore) locked -> (unlock) running;
  `--toggle` is lock+checkpoint or restore+unlock; any other transition fails with
  CUDA_ERROR_ILLEGAL_STATE, as unlock of a checkpointed process does (issue #44);
- success prints nothing (`--get-state` prints the state word, `--get-restore-tid` the tid); failure
  prints `Could not ACTION on process ID PID: "<CUDA error string>"` (`Error toggling CUDA in process
  ID PID: "..."` for --toggle) and exits with the CUDA error code & 0xFF (a process exit status);
- a restore that fails out of memory wedges the process as issue #44 reports: it stays
  checkpointed, later restores fail with CUDA_ERROR_OPERATING_SYSTEM and unlock with ILLEGAL_STATE;
- a restore with `--device-map` follows cuCheckpointProcessRestore: the map "must contain every
  checkpointed GPU" and each new GPU must "be of the same chip type as the old GPU"; otherwise it
  fails with "invalid argument" (what issue #35 shows for a map the driver refuses) and the process
  stays checkpointed, so a later restore may still succeed. After a move the process's GPUs are the
  new ones: a later checkpoint and restore start from those.

Deliberate difference: the real tool leaves the process's CPU threads running and blocks only its CUDA
calls. This fake has no CUDA to block, so `lock` sends SIGSTOP and `unlock` SIGCONT: a locked or
checkpointed process makes no progress at all, which tests can observe (/proc/PID/stat state T).
Every live process counts as a CUDA process (the real tool says "initialization error" for one
without CUDA). GPU memory is not tracked here: the daemon mirrors the release in its SimNVML.
The GPUs a process uses are the UUIDs in its CUDA_VISIBLE_DEVICES (read from /proc/PID/environ at
checkpoint; unreadable or unset: unknown, and a map is then not checked for coverage). The node's
GPUs and their models, which the real tool gets from the driver, are read from `<dir>/gpus.json`
({"GPU-uuid": "model"}; the daemon writes it on --sim, tests with `write_gpus`); a map onto a GPU
not listed there fails like one onto a GPU the node does not have.

State: one JSON file per locked/checkpointed pid in $GPUSCHED_SIM_CHECKPOINT_DIR (default
/tmp/gpusched-sim-checkpoint-UID), keyed by pid and the process's start time so a reused pid starts
out running. No file means running. Calls on the same directory are serialized with flock.
Failure injection for tests: `<dir>/<pid>.inject` holding JSON {"<operation>": "<CUDA error name>"}
fails that operation once (operation: lock, checkpoint, restore, unlock, get-state).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
from typing import Any

VERSION = "580.65.06"
DIR_ENV = "GPUSCHED_SIM_CHECKPOINT_DIR"
GPUS_FILE = "gpus.json"  # the node's GPUs as the driver knows them: {"GPU-uuid": "model"}

# CUDA error codes and cuGetErrorString() texts (cuda.h).
ERRORS: dict[str, tuple[int, str]] = {
    "CUDA_ERROR_INVALID_VALUE": (1, "invalid argument"),
    "CUDA_ERROR_OUT_OF_MEMORY": (2, "out of memory"),
    "CUDA_ERROR_NOT_INITIALIZED": (3, "initialization error"),
    "CUDA_ERROR_OPERATING_SYSTEM": (304, "OS call failed or operation not supported on this OS"),
    "CUDA_ERROR_ILLEGAL_STATE": (401, "the operation cannot be performed in the present state"),
    "CUDA_ERROR_NOT_PERMITTED": (800, "operation not permitted"),
    "CUDA_ERROR_NOT_SUPPORTED": (801, "operation not supported"),
    "CUDA_ERROR_TIMEOUT": (909, "wait operation timed out"),
}

HELP = f"""CUDA checkpoint and restore utility.
Version {VERSION}. Copyright (C) 2025 NVIDIA Corporation. All rights reserved.
(gpusched simulation: gpusched/gpu/simcheckpoint.py)

Operations:
--get-state --pid <pid>
\tPrints the current checkpoint state of the process specified by <pid>

--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>] [--device-map <uuids>]
\tPerforms the specified action on <pid>.
\tFor the lock action a timeout can be provided, the lock operation will wait up to <ms> milliseconds \
for the operation to succeed.
\tFor the restore action a device map can be provided in the format oldUuid=newUuid,oldUuid=newUuid,... \
which will be used to remap old devices to new devices.

--toggle --pid <pid>
\tToggles the CUDA state in the specified process between the running and checkpointed states

--get-restore-tid --pid <pid>
\tRetrieves the CUDA restore thread ID of the process specified by <pid>

Options:
--pid|-p <pid>
\tThe pid upon which to perform the operation

--timeout|-t <timeout>
\tOptional timeout that can be specified for the lock action in milliseconds

--device-map|-d <deviceUuids>
\tOptional device map used during the restore action to manually remap old devices onto new ones.

--help|-h
\tPrint this help message
"""


class CudaFailure(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.code, self.text = ERRORS[name]


class Usage(Exception):
    pass


def state_dir() -> str:
    return os.environ.get(DIR_ENV) or f"/tmp/gpusched-sim-checkpoint-{os.getuid()}"


def start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[19]


class Store:
    """The per-pid records under the state directory."""

    def __init__(self, root: str) -> None:
        self.root = root

    def _path(self, pid: int, suffix: str = "json") -> str:
        return os.path.join(self.root, f"{pid}.{suffix}")

    def load(self, pid: int, started: str) -> dict[str, Any]:
        try:
            with open(self._path(pid)) as f:
                record: dict[str, Any] = json.load(f)
        except (OSError, ValueError):
            return {"state": "running"}
        if record.get("start_time") != started:  # the pid was reused: the old record is stale
            self.drop(pid)
            return {"state": "running"}
        return record

    def save(self, pid: int, started: str, record: dict[str, Any]) -> None:
        # A moved process keeps its record while running: its GPUs are no longer its environment's.
        if record["state"] == "running" and not record.get("wedged") and not record.get("moved"):
            self.drop(pid)
            return
        record["start_time"] = started
        tmp = self._path(pid, "tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self._path(pid))

    def drop(self, pid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(pid))

    def gpus(self) -> dict[str, str]:
        """The node's GPUs (UUID -> model); none when the file is missing or unreadable."""
        try:
            with open(os.path.join(self.root, GPUS_FILE)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}

    def injected(self, pid: int, operation: str) -> str | None:
        """A failure a test asked for: consumed once."""
        path = self._path(pid, "inject")
        try:
            with open(path) as f:
                plan: dict[str, str] = json.load(f)
        except (OSError, ValueError):
            return None
        name = plan.pop(operation, None)
        if plan:
            with open(path, "w") as f:
                json.dump(plan, f)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if name is not None and name not in ERRORS:
            raise Usage(f"unknown CUDA error {name!r} in {path}")
        return name


def inject(directory: str, pid: int, operation: str, error: str) -> None:
    """Make the next `operation` on `pid` fail with CUDA error `error` (test hook)."""
    if error not in ERRORS:
        raise ValueError(f"unknown CUDA error {error!r}; one of {', '.join(ERRORS)}")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, f"{pid}.inject")
    plan: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        plan = json.load(f)
    plan[operation] = error
    with open(path, "w") as f:
        json.dump(plan, f)


def write_gpus(directory: str, gpus: dict[str, str]) -> None:
    """Tell the fake which GPUs the node has (UUID -> model), as the driver would know them."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = os.path.join(directory, GPUS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(gpus, f)
    os.replace(tmp, os.path.join(directory, GPUS_FILE))


def visible_devices(pid: int) -> list[str]:
    """The GPU UUIDs in the process's CUDA_VISIBLE_DEVICES (the GPUs its CUDA context can be on);
    empty when unset, unreadable, or not UUIDs (then unknown)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return []
    for entry in entries:
        if entry.startswith(b"CUDA_VISIBLE_DEVICES="):
            uuids = entry.partition(b"=")[2].decode(errors="replace").split(",")
            return uuids if all(u.startswith("GPU-") for u in uuids) else []
    return []


def check_device_map(record: dict[str, Any], device_map: dict[str, str], gpus: dict[str, str]) -> None:
    """cuCheckpointProcessRestore's rules for a map: every checkpointed GPU is named, and each new
    GPU exists and is the same chip as the old one (a GPU mapped onto itself is always fine)."""
    if any(uuid not in device_map for uuid in record.get("devices") or ()):
        raise CudaFailure("CUDA_ERROR_INVALID_VALUE")
    for old, new in device_map.items():
        if new != old and (old not in gpus or gpus.get(new) != gpus[old]):
            raise CudaFailure("CUDA_ERROR_INVALID_VALUE")


def signal_process(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise CudaFailure("CUDA_ERROR_INVALID_VALUE") from None
    except PermissionError:
        raise CudaFailure("CUDA_ERROR_NOT_PERMITTED") from None


def step(store: Store, pid: int, record: dict[str, Any], action: str, device_map: dict[str, str] | None) -> None:
    """One --action on a live pid; changes `record` in place."""
    state = record["state"]
    failure = store.injected(pid, action)
    if action == "restore" and record.get("wedged"):
        failure = "CUDA_ERROR_OPERATING_SYSTEM"  # issue #44: every restore after a failed one
    if failure is not None:
        if action == "restore" and failure == "CUDA_ERROR_OUT_OF_MEMORY":
            record["wedged"] = True
        raise CudaFailure(failure)
    allowed = {"lock": "running", "checkpoint": "locked", "restore": "checkpointed", "unlock": "locked"}
    if state != allowed[action]:
        raise CudaFailure("CUDA_ERROR_ILLEGAL_STATE")
    if action == "lock":
        signal_process(pid, signal.SIGSTOP)  # the fake's stand-in for "CUDA calls block"
        record["state"] = "locked"
    elif action == "checkpoint":
        if not record.get("moved"):
            record["devices"] = visible_devices(pid)
        record["state"] = "checkpointed"
    elif action == "restore":
        if device_map:
            check_device_map(record, device_map, store.gpus())
            devices = record.get("devices") or []
            record["devices"] = [device_map.get(u, u) for u in devices]
            record["device_map"] = device_map
            record["moved"] = record.get("moved") or record["devices"] != devices
        record["state"] = "locked"
    else:
        signal_process(pid, signal.SIGCONT)
        record["state"] = "running"


def parse(argv: list[str]) -> dict[str, str]:
    opts: dict[str, str] = {}
    names = {"-p": "pid", "--pid": "pid", "-t": "timeout", "--timeout": "timeout", "-d": "device-map",
             "--device-map": "device-map", "--action": "action"}
    flags = {"--get-state": "get-state", "--toggle": "toggle", "--get-restore-tid": "get-restore-tid",
             "--help": "help", "-h": "help"}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in flags:
            opts["op"] = opts["op"] + "," + flags[arg] if "op" in opts else flags[arg]
            i += 1
        elif arg in names:
            if i + 1 >= len(argv):
                raise Usage(f"missing value for {arg}")
            if names[arg] == "action":
                opts["op"] = opts["op"] + ",action" if "op" in opts else "action"
            opts[names[arg]] = argv[i + 1]
            i += 2
        else:
            raise Usage(f"unknown option {arg!r}")
    return opts


def parse_device_map(text: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in text.split(","):
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise CudaFailure("CUDA_ERROR_INVALID_VALUE")
        pairs[old] = new
    return pairs


def run(argv: list[str]) -> int:
    try:
        opts = parse(argv)
    except Usage as err:
        print(f"{err}\n\n{HELP}", file=sys.stderr, end="")
        return 1
    op = opts.get("op")
    if op == "help":
        print(HELP, end="")
        return 0
    if op not in ("get-state", "action", "toggle", "get-restore-tid") or "pid" not in opts:
        print(f"exactly one operation and a --pid are required\n\n{HELP}", file=sys.stderr, end="")
        return 1
    action = opts.get("action", "")
    if op == "action" and action not in ("lock", "checkpoint", "restore", "unlock"):
        print(f"unknown action {action!r}\n\n{HELP}", file=sys.stderr, end="")
        return 1
    if "device-map" in opts and action != "restore":
        print("--device-map is only allowed for the restore action", file=sys.stderr)
        return 1
    if "timeout" in opts and not opts["timeout"].isdigit():
        print(f"invalid timeout {opts['timeout']!r}", file=sys.stderr)
        return 1
    what = {"get-state": "get state", "get-restore-tid": "get restore thread ID"}.get(op, action)
    try:
        if not opts["pid"].isdigit() or int(opts["pid"]) <= 0:
            raise CudaFailure("CUDA_ERROR_INVALID_VALUE")
        pid = int(opts["pid"])
        device_map = parse_device_map(opts["device-map"]) if "device-map" in opts else None
        root = state_dir()
        os.makedirs(root, mode=0o700, exist_ok=True)
        if os.stat(root).st_uid != os.getuid():  # a predictable /tmp name: never trust another user's
            raise Usage(f"{root} is owned by uid {os.stat(root).st_uid}, not by us; set {DIR_ENV}")
        with open(os.path.join(root, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return operate(Store(root), op, action, pid, device_map)
    except CudaFailure as err:
        if op == "toggle":
            print(f'Error toggling CUDA in process ID {opts["pid"]}: "{err.text}"', file=sys.stderr)
        else:
            print(f'Could not {what} on process ID {opts["pid"]}: "{err.text}"', file=sys.stderr)
        return err.code & 0xFF
    except Usage as err:
        print(str(err), file=sys.stderr)
        return 1


def operate(store: Store, op: str, action: str, pid: int, device_map: dict[str, str] | None) -> int:
    started = start_time(pid)
    if started is None:
        raise CudaFailure("CUDA_ERROR_INVALID_VALUE")  # no such process (or a zombie)
    record = store.load(pid, started)
    if op == "get-state":
        failure = store.injected(pid, "get-state")
        if failure is not None:
            raise CudaFailure(failure)
        print(record["state"])
        return 0
    if op == "get-restore-tid":
        print(pid)  # the fake has no separate restore thread: the main thread stands in for it
        return 0
    try:
        if op == "toggle":
            if record["state"] == "running":
                for each in ("lock", "checkpoint"):
                    step(store, pid, record, each, None)
            elif record["state"] == "checkpointed":
                for each in ("restore", "unlock"):
                    step(store, pid, record, each, None)
            else:
                raise CudaFailure("CUDA_ERROR_ILLEGAL_STATE")
        else:
            step(store, pid, record, action, device_map)
    finally:
        store.save(pid, started, record)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
