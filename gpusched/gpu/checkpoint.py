"""Loss-free preemption of whole-GPU jobs with NVIDIA's `cuda-checkpoint` utility (mechanism only).

`cuda-checkpoint` (github.com/NVIDIA/cuda-checkpoint, README; driver r550+) suspends the CUDA state of
one Linux process: it locks the CUDA driver API, waits for submitted work, copies device memory to
host memory and releases every GPU resource, so the process vanishes from `nvidia-smi` while its CPU
threads keep running (CUDA calls block). Restore re-acquires the GPU and copies memory back at the
same addresses. That frees a whole GPU for another job without losing the preempted one's work.

The program's CLI (help text quoted in the README for 570.86.10 and, with `--device-map`, for
580.65.06 in NVIDIA/cuda-checkpoint#18) is what we speak:

    cuda-checkpoint --get-state --pid PID          prints running | locked | checkpointed (| failed)
    cuda-checkpoint --action lock --pid PID [--timeout MS]
    cuda-checkpoint --action checkpoint|restore|unlock --pid PID
    cuda-checkpoint --toggle --pid PID             lock+checkpoint, or restore+unlock
    cuda-checkpoint --get-restore-tid --pid PID    prints a thread id
    cuda-checkpoint --action restore --pid PID --device-map OLD=NEW,...   (r580+) restore onto other GPUs

Success prints nothing (README; issue #42); a failure prints `Could not ACTION on process ID PID:
"<CUDA error string>"` (issues #10, #35, #42) and exits with the CUDA error code, truncated to 8 bits
by exit(2) (criu PR #2540: "it always returns the positive CUDA error code"). `restore` leaves the
process *locked*; `unlock` makes it running (CUDA samples, processCheckpoint README).

Limits that decide *whether* we may checkpoint a job (`unsupported_reason`): x86-64 only, no UVM or
IPC memory, no rollback after an error (README "Functionality"); MIG is not supported (issue #42:
checkpoint fails with "out of memory" on a MIG slice); multi-process NCCL jobs can hang (issue #30);
a restore that fails with out of memory leaves the process stuck in CHECKPOINTED (issue #44).
MPS clients: not documented anywhere we found, so we refuse them.

Every call runs the program as a subprocess on the event loop (never blocking it), without a shell,
with a hard deadline (the process group is killed when it passes) and a bounded output read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Final, Literal

from gpusched.gpu.backend import GpuError
from gpusched.model import Allocation

DEFAULT_BINARY: Final = "cuda-checkpoint"
STATES: Final = ("running", "locked", "checkpointed", "failed")
State = Literal["running", "locked", "checkpointed", "failed"]
MAX_OUTPUT_BYTES: Final = 64 * 1024  # the tool prints one line; anything past this is drained and dropped
MIN_DRIVER_MAJOR: Final = 550  # README: "supports display driver version 550 and higher"
MOVE_DRIVER_MAJOR: Final = 580  # --device-map (restore onto other GPUs) first shipped with 580.65.06
_QUOTED_ERROR = re.compile(r'"([^"]*)"\s*$')


class CheckpointError(GpuError):
    """A cuda-checkpoint call failed. `code` is the program's exit status (None: it did not exit by
    itself), `cuda_error` the quoted CUDA error string it printed, `state` the process's CUDA state
    read back after the failure when we could (None when unknown)."""

    code = "checkpoint_failed"  # GpuError.code is the stable error kind; the exit status is `exit_code`

    def __init__(self, pid: int, message: str, exit_code: int | None = None, *,
                 cuda_error: str | None = None, state: str | None = None, hint: str = "") -> None:
        super().__init__(f"cuda-checkpoint on pid {pid}: {message}", hint=hint)
        self.pid = pid
        self.exit_code = exit_code
        self.cuda_error = cuda_error
        self.state = state


def available(binary: str = DEFAULT_BINARY) -> bool:
    """True when `binary` can be run: an executable file (a bare name is looked up in PATH), or our
    simulated program as a readable `.py` file (we run that with this interpreter)."""
    if binary.endswith(".py") and os.path.isfile(binary):
        return os.access(binary, os.R_OK)
    return shutil.which(binary) is not None


def checkpoint_binary(configured: str | None, *, sim: bool) -> str:
    """The program to run: the configured one, else the simulated one on simulated GPUs
    (gpu/simcheckpoint.py, as launch.py picks simmps.py), else `cuda-checkpoint` from PATH."""
    if configured is not None:
        return configured
    if sim:
        from gpusched.gpu import simcheckpoint

        return simcheckpoint.__file__
    return DEFAULT_BINARY


def command_prefix(binary: str) -> list[str]:
    """argv that runs `binary`. A `.py` file (gpu/simcheckpoint.py) runs under this interpreter in
    isolated mode, so a lost exec bit or a different `python3` in PATH cannot break it."""
    if binary.endswith(".py"):
        return [sys.executable, "-I", binary]
    return [binary]


def driver_can_move(driver_version: str | None) -> bool:
    """Can this driver restore a checkpoint onto other GPUs (`--device-map`, r580+)? Unknown or
    unreadable versions say no: a restore that cannot map fails, and the job with it."""
    major = (driver_version or "").split(".", 1)[0]
    return major.isdigit() and int(major) >= MOVE_DRIVER_MAJOR


def unsupported_reason(allocation: Allocation | None, *, machine: str, driver_version: str | None = None) -> str | None:
    """Why a job with this allocation cannot be preempted by checkpointing, or None when it can.

    Pure: the caller passes `platform.machine()` and the NVML driver version. Only whole GPUs not
    shared with other jobs qualify (the scheduler's preemption of MIG and shares stays requeue).
    """
    if machine not in ("x86_64", "amd64", "AMD64"):
        return f"cuda-checkpoint is x86-64 only; this node is {machine}"
    if driver_version is not None:
        major = driver_version.split(".", 1)[0]
        if not major.isdigit():
            return f"unreadable driver version {driver_version!r}"
        if int(major) < MIN_DRIVER_MAJOR:
            return f"driver {driver_version} is older than r{MIN_DRIVER_MAJOR}, the first with cuda-checkpoint"
    if allocation is None or not allocation.devices:
        return "the job holds no GPU"
    mig = [d.uuid for d in allocation.devices if d.kind != "gpu"]
    if mig:
        return f"the job runs on MIG instance {mig[0]}; cuda-checkpoint does not support MIG"
    if "CUDA_MPS_PIPE_DIRECTORY" in allocation.env:
        return "the job is an MPS client; checkpointing MPS clients is not supported"
    if allocation.share is not None:
        return f"the job shares a GPU (share {allocation.share:g}); only whole-GPU jobs are checkpointed"
    return None


def format_device_map(device_map: Mapping[str, str]) -> str:
    """`--device-map`'s argument: `old=new,old=new` in the mapping's order. UUIDs never hold `=` or
    `,`; a value that does is refused here rather than sent as a different map."""
    for uuid in (*device_map.keys(), *device_map.values()):
        if not uuid or "=" in uuid or "," in uuid:
            raise ValueError(f"not a GPU UUID for --device-map: {uuid!r}")
    return ",".join(f"{old}={new}" for old, new in device_map.items())


class CudaCheckpoint:
    """Runs `cuda-checkpoint` (or gpu/simcheckpoint.py on simulated GPUs) for one pid at a time.

    `timeout_s` is the hard deadline of each program run. `lock_timeout_ms` is passed to
    `--action lock --timeout`; it defaults to half the deadline so the tool gives up (and leaves the
    process running) before we have to kill it, which could leave the process locked (criu #26).
    """

    def __init__(self, binary: str = DEFAULT_BINARY, timeout_s: float = 30.0, *,
                 lock_timeout_ms: int | None = None, env: Mapping[str, str] | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.binary = binary
        self.timeout_s = timeout_s
        self.lock_timeout_ms = lock_timeout_ms if lock_timeout_ms is not None else max(1, int(timeout_s * 500))
        self.env = dict(env) if env is not None else None

    def available(self) -> bool:
        return available(self.binary)

    # ------------------------------------------------------------------ running the program

    async def run(self, pid: int, args: Sequence[str]) -> tuple[int, str]:
        """Run the program once; returns (exit status, output). Raises CheckpointError when it cannot
        start, passes the deadline (its process group is killed) or dies of a signal."""
        argv = [*command_prefix(self.binary), *args]
        what = " ".join(args)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=self.env,
                start_new_session=True,  # its own group: a deadline kills it and anything it started
            )
        except OSError as err:
            raise CheckpointError(pid, f"cannot run {self.binary!r}: {err.strerror or err}",
                                  hint="install cuda-checkpoint (driver r550+) or set the checkpoint binary path"
                                  ) from None
        assert proc.stdout is not None
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await _read_bounded(proc.stdout, MAX_OUTPUT_BYTES)
                status = await proc.wait()
        except TimeoutError:
            raise CheckpointError(pid, f"`{what}` did not finish within {self.timeout_s:g}s; killed it",
                                  hint="the process's CUDA state is unknown: read it with --get-state") from None
        finally:
            if proc.returncode is None:  # deadline, or our caller was cancelled: never leave it running
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        text = out.decode(errors="replace").strip()
        if status < 0:
            raise CheckpointError(pid, f"`{what}` was killed by signal {-status}: {text or 'no output'}", status)
        return status, text

    async def _call(self, pid: int, args: Sequence[str]) -> str:
        status, text = await self.run(pid, args)
        if status != 0:
            quoted = _QUOTED_ERROR.search(text)
            raise CheckpointError(pid, text.splitlines()[-1] if text else f"`{' '.join(args)}` exited {status}",
                                  status, cuda_error=quoted.group(1) if quoted else None)
        return text

    # ------------------------------------------------------------------ operations

    async def state(self, pid: int) -> State:
        """The process's CUDA state: running, locked, checkpointed or failed."""
        text = await self._call(pid, ["--get-state", "--pid", str(pid)])
        word = text.strip()
        for state in STATES:
            if word == state:
                return state
        raise CheckpointError(pid, f"--get-state printed {text[:200]!r}, not one of {', '.join(STATES)}")

    async def restore_tid(self, pid: int) -> int:
        """The CUDA restore thread id (CRIU needs it; we only use it to probe)."""
        text = await self._call(pid, ["--get-restore-tid", "--pid", str(pid)])
        if not text.isdigit() or int(text) <= 0:
            raise CheckpointError(pid, f"--get-restore-tid printed {text[:200]!r}, not a thread id")
        return int(text)

    async def action(self, pid: int, action: Literal["lock", "checkpoint", "restore", "unlock"], *,
                     device_map: Mapping[str, str] | None = None) -> None:
        """One step. `device_map` (old GPU UUID -> new, restore only; r580+) restores onto other GPUs."""
        args = ["--action", action, "--pid", str(pid)]
        if action == "lock":
            args += ["--timeout", str(self.lock_timeout_ms)]
        if device_map:
            if action != "restore":
                raise ValueError("a device map applies to the restore action only")
            args += ["--device-map", format_device_map(device_map)]
        await self._call(pid, args)

    async def checkpoint(self, pid: int) -> None:
        """running -> locked -> checkpointed: the process's GPU memory moves to host memory and the GPU
        is released. Already checkpointed: nothing to do. A failed step is rolled back by unlocking
        when the process is left locked, so the job keeps running; the error says which state the
        process is in (`CheckpointError.state`)."""
        current = await self.state(pid)
        if current == "checkpointed":
            return
        if current == "failed":
            raise CheckpointError(pid, "CUDA state is failed; it cannot be checkpointed", state=current)
        try:
            if current == "running":
                await self.action(pid, "lock")
            await self.action(pid, "checkpoint")
        except CheckpointError as err:
            await self._roll_back(pid, err)
            raise

    async def _roll_back(self, pid: int, err: CheckpointError) -> None:
        """After a failed lock or checkpoint step: read the state back and, when the process is left
        locked (a lock that failed late, or one we killed at the deadline; criu does the same), unlock
        it so the job runs on. `err.state` ends up as the state the process is really in."""
        err.state = await self._state_or_none(pid)
        if err.state == "locked":
            with contextlib.suppress(CheckpointError):
                await self.action(pid, "unlock")
                err.state = "running"

    async def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        """checkpointed -> locked -> running. Already running: nothing to do. A restore that fails
        (typically out of GPU memory) leaves the process checkpointed; per NVIDIA/cuda-checkpoint#44
        later restores may then fail for good, and only killing the process helps.

        `device_map` (old GPU UUID -> new GPU UUID, r580+) restores onto other GPUs of the same chip;
        it must name every GPU the process was checkpointed on (cuCheckpointProcessRestore), else
        the program fails with "invalid argument" and the process stays checkpointed."""
        current = await self.state(pid)
        if current == "running":
            return
        if current == "failed":
            raise CheckpointError(pid, "CUDA state is failed; it cannot be restored", state=current)
        try:
            if current == "checkpointed":
                await self.action(pid, "restore", device_map=device_map)
            await self.action(pid, "unlock")
        except CheckpointError as err:
            err.state = await self._state_or_none(pid)
            raise

    async def _state_or_none(self, pid: int) -> State | None:
        try:
            return await self.state(pid)
        except CheckpointError:
            return None


async def _read_bounded(stream: asyncio.StreamReader, limit: int) -> bytes:
    """Read to EOF, keeping at most `limit` bytes (the rest is drained so the writer never blocks)."""
    kept = bytearray()
    while chunk := await stream.read(65536):
        if len(kept) < limit:
            kept += chunk[: limit - len(kept)]
    return bytes(kept)
