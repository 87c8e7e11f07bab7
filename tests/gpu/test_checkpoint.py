"""cuda-checkpoint wrapper against gpusched/gpu/simcheckpoint.py (the simulated program): real processes."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpusched.gpu import simcheckpoint
from gpusched.gpu.checkpoint import (
    MAX_OUTPUT_BYTES,
    CheckpointError,
    CudaCheckpoint,
    available,
    checkpoint_binary,
    driver_can_move,
    format_device_map,
    unsupported_reason,
)
from gpusched.model import AllocatedDevice, Allocation

FAKE = str(Path(__file__).resolve().parents[2] / "gpusched" / "gpu" / "simcheckpoint.py")
GPU = AllocatedDevice(uuid="GPU-e1080000-1111-2222-3333-444455556666", gpu_index=0, kind="gpu")
MIG = AllocatedDevice(uuid="MIG-0b8c1e55-2b0e-4d7a-9d59-8b1f4f0c2a11", gpu_index=0, kind="mig", profile="3g.40gb")


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def proc_state(pid: int) -> str:
    """The scheduler state letter from /proc/PID/stat (R, S, T, Z, ...), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


@pytest.fixture
def sim_dir(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def cc(sim_dir: Path) -> CudaCheckpoint:
    return CudaCheckpoint(FAKE, timeout_s=20, env={**os.environ, simcheckpoint.DIR_ENV: str(sim_dir)})


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in job process; continued and killed whatever a test left it in."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    for sig in (signal.SIGCONT, signal.SIGKILL):
        if proc.poll() is None:
            os.kill(proc.pid, sig)
    proc.wait(timeout=10)


@pytest.fixture
def counter(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A process that makes visible progress: it rewrites a counter file as fast as it can."""
    out = tmp_path / "count"
    code = ("import os,sys\np=sys.argv[1]\ni=0\nwhile True:\n i+=1\n"
            " open(p+'.tmp','w').write(str(i))\n os.replace(p+'.tmp',p)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)])
    yield proc, out
    for sig in (signal.SIGCONT, signal.SIGKILL):
        if proc.poll() is None:
            os.kill(proc.pid, sig)
    proc.wait(timeout=10)


def read_count(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------------------- the round trip


def test_checkpoint_stops_the_process_and_restore_resumes_it(cc: CudaCheckpoint,
                                                             counter: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, out = counter
    assert wait_for(lambda: read_count(out) > 0)
    assert asyncio.run(cc.state(proc.pid)) == "running"

    asyncio.run(cc.checkpoint(proc.pid))
    assert wait_for(lambda: proc_state(proc.pid) == "T")
    assert asyncio.run(cc.state(proc.pid)) == "checkpointed"
    frozen = read_count(out)
    assert proc_state(proc.pid) == "T"  # still stopped after our own round trip through the tool

    asyncio.run(cc.restore(proc.pid))
    assert asyncio.run(cc.state(proc.pid)) == "running"
    assert wait_for(lambda: proc_state(proc.pid) in ("R", "S"))
    assert wait_for(lambda: read_count(out) > frozen)  # the job makes progress again


def test_checkpoint_and_restore_are_idempotent(cc: CudaCheckpoint, child: subprocess.Popen[bytes]) -> None:
    async def go() -> list[str]:
        seen: list[str] = []
        for op in (cc.checkpoint, cc.checkpoint, cc.restore, cc.restore):
            await op(child.pid)
            seen.append(await cc.state(child.pid))
        return seen

    assert asyncio.run(go()) == ["checkpointed", "checkpointed", "running", "running"]
    assert wait_for(lambda: proc_state(child.pid) == "S")


def test_restore_finishes_a_locked_process(cc: CudaCheckpoint, child: subprocess.Popen[bytes]) -> None:
    """A process left locked (e.g. a daemon crash between lock and checkpoint) is unlocked by restore."""
    asyncio.run(cc.action(child.pid, "lock"))
    assert asyncio.run(cc.state(child.pid)) == "locked"
    assert wait_for(lambda: proc_state(child.pid) == "T")
    asyncio.run(cc.restore(child.pid))
    assert asyncio.run(cc.state(child.pid)) == "running"
    assert wait_for(lambda: proc_state(child.pid) == "S")


def test_checkpoint_issues_lock_with_timeout_then_checkpoint(tmp_path: Path) -> None:
    log = tmp_path / "argv"
    fake = script(tmp_path, "cc", f'echo "$@" >> {log}\n[ "$1" = --get-state ] && echo running\nexit 0\n')
    asyncio.run(CudaCheckpoint(fake, timeout_s=8).checkpoint(42))
    assert log.read_text().splitlines() == [
        "--get-state --pid 42",
        "--action lock --pid 42 --timeout 4000",
        "--action checkpoint --pid 42",
    ]


# ---------------------------------------------------------------------------- errors


def test_dead_pid_is_an_error(cc: CudaCheckpoint) -> None:
    pid = dead_pid()
    with pytest.raises(CheckpointError) as info:
        asyncio.run(cc.state(pid))
    err = info.value
    assert err.pid == pid and err.exit_code == 1 and err.cuda_error == "invalid argument"
    assert f"process ID {pid}" in err.message and err.code == "checkpoint_failed"
    with pytest.raises(CheckpointError, match="invalid argument"):
        asyncio.run(cc.checkpoint(pid))


def test_failed_checkpoint_step_is_rolled_back(cc: CudaCheckpoint, sim_dir: Path,
                                               child: subprocess.Popen[bytes]) -> None:
    simcheckpoint.inject(str(sim_dir), child.pid, "checkpoint", "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(CheckpointError) as info:
        asyncio.run(cc.checkpoint(child.pid))
    assert info.value.cuda_error == "out of memory" and info.value.exit_code == 2
    assert info.value.state == "running"  # it was locked; the wrapper unlocked it so the job goes on
    assert asyncio.run(cc.state(child.pid)) == "running"
    assert wait_for(lambda: proc_state(child.pid) == "S")


def test_lock_timeout_leaves_the_process_running(cc: CudaCheckpoint, sim_dir: Path,
                                                 child: subprocess.Popen[bytes]) -> None:
    simcheckpoint.inject(str(sim_dir), child.pid, "lock", "CUDA_ERROR_TIMEOUT")
    with pytest.raises(CheckpointError) as info:
        asyncio.run(cc.checkpoint(child.pid))
    assert info.value.exit_code == 909 & 0xFF and info.value.state == "running"
    assert proc_state(child.pid) == "S"


def test_lock_killed_at_the_deadline_is_rolled_back(tmp_path: Path, sim_dir: Path,
                                                   child: subprocess.Popen[bytes]) -> None:
    """The lock took effect but the program hung (criu #26): the wrapper kills it, finds the process
    locked and unlocks it, so the job runs on."""
    fake = f"{sys.executable} -I {FAKE}"
    hangs_after_lock = script(tmp_path, "cc", f'{fake} "$@" || exit $?\n[ "$2" = lock ] && exec sleep 600\nexit 0\n')
    cc = CudaCheckpoint(hangs_after_lock, timeout_s=3, env={**os.environ, simcheckpoint.DIR_ENV: str(sim_dir)})
    with pytest.raises(CheckpointError, match="did not finish") as info:
        asyncio.run(cc.checkpoint(child.pid))
    assert info.value.state == "running" and info.value.exit_code is None
    assert asyncio.run(cc.state(child.pid)) == "running"
    assert wait_for(lambda: proc_state(child.pid) == "S")


def test_restore_out_of_memory_wedges_the_process(cc: CudaCheckpoint, sim_dir: Path,
                                                  child: subprocess.Popen[bytes]) -> None:
    """NVIDIA/cuda-checkpoint#44: after a restore fails out of memory, every later restore fails (304)."""
    asyncio.run(cc.checkpoint(child.pid))
    simcheckpoint.inject(str(sim_dir), child.pid, "restore", "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(CheckpointError) as first:
        asyncio.run(cc.restore(child.pid))
    assert first.value.cuda_error == "out of memory" and first.value.state == "checkpointed"
    with pytest.raises(CheckpointError) as second:
        asyncio.run(cc.restore(child.pid))
    assert second.value.exit_code == 304 & 0xFF
    assert second.value.cuda_error == "OS call failed or operation not supported on this OS"
    assert proc_state(child.pid) == "T"


def test_deadline_kills_the_program_and_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild"
    hang = script(tmp_path, "hang", f"sleep 600 &\necho $! > {pidfile}\nwait\n")
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"did not finish within 0\.5s"):
        asyncio.run(CudaCheckpoint(hang, timeout_s=0.5).state(1))
    assert time.monotonic() - started < 5
    grandchild = int(pidfile.read_text())
    assert wait_for(lambda: proc_state(grandchild) in ("gone", "Z"))


def test_cancelled_call_kills_the_program(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    hang = script(tmp_path, "hang", f"echo $$ > {pidfile}\nexec sleep 600\n")

    async def go() -> None:
        task = asyncio.create_task(CudaCheckpoint(hang, timeout_s=60).state(1))
        while not pidfile.exists() or not pidfile.read_text().strip():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(go(), 10))
    assert wait_for(lambda: proc_state(int(pidfile.read_text())) in ("gone", "Z"))


def test_a_hanging_call_does_not_block_the_loop(tmp_path: Path, cc: CudaCheckpoint,
                                                child: subprocess.Popen[bytes]) -> None:
    hang = script(tmp_path, "hang", "exec sleep 600\n")

    async def go() -> bool:
        slow = asyncio.create_task(CudaCheckpoint(hang, timeout_s=60).state(child.pid))
        assert await cc.state(child.pid) == "running"  # answered while the hanging call is in flight
        still_waiting = not slow.done()
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        return still_waiting

    assert asyncio.run(asyncio.wait_for(go(), 30))


def test_unexpected_output_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not one of running"):
        asyncio.run(CudaCheckpoint(script(tmp_path, "odd", "echo banana\n"), timeout_s=5).state(7))
    with pytest.raises(CheckpointError, match="not a thread id"):
        asyncio.run(CudaCheckpoint(script(tmp_path, "odd2", "echo -3\n"), timeout_s=5).restore_tid(7))


def test_output_read_is_bounded(tmp_path: Path) -> None:
    loud = script(tmp_path, "loud", "head -c 3000000 /dev/zero | tr '\\0' x\necho\necho running\n")
    status, text = asyncio.run(CudaCheckpoint(loud, timeout_s=20).run(7, ["--get-state", "--pid", "7"]))
    assert status == 0 and len(text) == MAX_OUTPUT_BYTES  # the rest was drained, not kept
    with pytest.raises(CheckpointError) as info:
        asyncio.run(CudaCheckpoint(loud, timeout_s=20).state(7))
    assert len(info.value.message) < 400


def test_killed_by_signal_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="killed by signal 9"):
        asyncio.run(CudaCheckpoint(script(tmp_path, "boom", "kill -9 $$\n"), timeout_s=5).state(7))


def test_missing_program(tmp_path: Path) -> None:
    missing = str(tmp_path / "cuda-checkpoint")
    assert not available(missing)
    with pytest.raises(CheckpointError, match="cannot run") as info:
        asyncio.run(CudaCheckpoint(missing).state(1))
    assert "cuda-checkpoint" in info.value.hint
    with pytest.raises(ValueError, match="timeout_s"):
        CudaCheckpoint(missing, timeout_s=0)


def test_checkpoint_binary() -> None:
    assert checkpoint_binary("/opt/nvidia/cuda-checkpoint", sim=True) == "/opt/nvidia/cuda-checkpoint"
    assert checkpoint_binary(None, sim=False) == "cuda-checkpoint"
    assert os.path.samefile(checkpoint_binary(None, sim=True), FAKE)


def test_available(tmp_path: Path) -> None:
    assert available(FAKE)
    assert available("sh")
    assert not available("no-such-program-gpusched")
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    assert not available(str(plain))  # not executable


# ---------------------------------------------------------------------------- the simulated program itself


def test_fake_runs_without_its_exec_bit(tmp_path: Path, sim_dir: Path, child: subprocess.Popen[bytes]) -> None:
    copy = tmp_path / "simcheckpoint.py"
    shutil.copy(FAKE, copy)
    copy.chmod(0o644)
    cc = CudaCheckpoint(str(copy), timeout_s=20, env={**os.environ, simcheckpoint.DIR_ENV: str(sim_dir)})
    assert cc.available()
    asyncio.run(cc.checkpoint(child.pid))
    assert asyncio.run(cc.state(child.pid)) == "checkpointed"
    asyncio.run(cc.restore(child.pid))


def test_fake_is_executable_in_git_and_on_disk() -> None:
    assert os.stat(FAKE).st_mode & stat.S_IXUSR
    assert Path(FAKE).read_text().startswith("#!/usr/bin/env python3\n")
    repo = Path(FAKE).parents[2]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-s", "gpusched/gpu/simcheckpoint.py"],
                         capture_output=True, text=True, check=True).stdout
    if not out:
        pytest.skip("simcheckpoint.py not committed yet")
    assert out.startswith("100755 ")


def fake_cli(args: list[str], sim_dir: Path, *, isolated: bool = False) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-I", FAKE] if isolated else [FAKE]
    env = {**os.environ, simcheckpoint.DIR_ENV: str(sim_dir)}
    return subprocess.run([*argv, *args], capture_output=True, text=True, env=env, timeout=30)


def test_fake_cli_speaks_the_real_messages(sim_dir: Path, child: subprocess.Popen[bytes]) -> None:
    pid = str(child.pid)
    help_ = fake_cli(["--help"], sim_dir)
    assert help_.returncode == 0 and "--action lock | checkpoint | restore | unlock" in help_.stdout

    assert fake_cli(["--get-state", "--pid", pid], sim_dir, isolated=True).stdout == "running\n"
    wrong = fake_cli(["--action", "unlock", "--pid", pid], sim_dir)
    assert wrong.returncode == 401 & 0xFF
    assert wrong.stderr.strip() == (f'Could not unlock on process ID {pid}: '
                                    '"the operation cannot be performed in the present state"')

    toggled = fake_cli(["--toggle", "-p", pid], sim_dir)
    assert (toggled.returncode, toggled.stdout, toggled.stderr) == (0, "", "")
    assert fake_cli(["--get-state", "--pid", pid], sim_dir).stdout == "checkpointed\n"
    assert wait_for(lambda: proc_state(child.pid) == "T")
    assert fake_cli(["--toggle", "--pid", pid], sim_dir).returncode == 0
    assert fake_cli(["--get-state", "--pid", pid], sim_dir).stdout == "running\n"

    gone = str(dead_pid())
    dead = fake_cli(["--toggle", "--pid", gone], sim_dir)
    assert dead.returncode == 1
    assert dead.stderr.strip() == f'Error toggling CUDA in process ID {gone}: "invalid argument"'
    assert fake_cli(["--get-restore-tid", "--pid", pid], sim_dir).stdout.strip().isdigit()


def test_fake_cli_rejects_bad_usage(sim_dir: Path, child: subprocess.Popen[bytes]) -> None:
    pid = str(child.pid)
    for args in (["--get-state"], ["--action", "freeze", "--pid", pid], ["--bogus"],
                 ["--action", "lock", "--pid", pid, "--device-map", "a=b"],
                 ["--action", "lock", "--pid", pid, "--timeout", "soon"], ["--get-state", "--toggle", "--pid", pid]):
        result = fake_cli(args, sim_dir)
        assert result.returncode != 0 and result.stderr, args
    assert fake_cli(["--get-state", "--pid", pid], sim_dir).stdout == "running\n"  # nothing changed


def test_fake_device_map_only_on_restore(sim_dir: Path, child: subprocess.Popen[bytes]) -> None:
    pid = str(child.pid)
    for action in ("lock", "checkpoint"):
        assert fake_cli(["--action", action, "--pid", pid], sim_dir).returncode == 0
    bad = fake_cli(["--action", "restore", "--pid", pid, "-d", "GPU-a"], sim_dir)
    assert bad.returncode == 1 and '"invalid argument"' in bad.stderr
    simcheckpoint.write_gpus(str(sim_dir), {"GPU-a": "H100-80GB", "GPU-b": "H100-80GB"})
    assert fake_cli(["--action", "restore", "--pid", pid, "-d", "GPU-a=GPU-b"], sim_dir).returncode == 0
    assert fake_cli(["--get-state", "--pid", pid], sim_dir).stdout == "locked\n"
    assert fake_cli(["--action", "unlock", "--pid", pid], sim_dir).returncode == 0


@pytest.fixture
def on_gpu0() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in job process whose CUDA context is on GPU-0 (its CUDA_VISIBLE_DEVICES)."""
    proc = subprocess.Popen(["sleep", "600"], env={**os.environ, "CUDA_VISIBLE_DEVICES": "GPU-0"})
    yield proc
    for sig in (signal.SIGCONT, signal.SIGKILL):
        if proc.poll() is None:
            os.kill(proc.pid, sig)
    proc.wait(timeout=10)


def test_fake_restores_onto_another_gpu_of_the_same_chip_only(sim_dir: Path,
                                                              on_gpu0: subprocess.Popen[bytes]) -> None:
    """cuCheckpointProcessRestore: the new GPU must be the same chip, must exist, and the map must
    name every checkpointed GPU; a refused map leaves the process checkpointed for another try."""
    pid = str(on_gpu0.pid)
    simcheckpoint.write_gpus(str(sim_dir), {"GPU-0": "H100-80GB", "GPU-1": "H100-80GB", "GPU-2": "A100-80GB"})
    assert fake_cli(["--toggle", "--pid", pid], sim_dir).returncode == 0
    for refused in ("GPU-0=GPU-2",  # another chip
                    "GPU-0=GPU-9",  # no such GPU on this node
                    "GPU-1=GPU-0"):  # does not name GPU-0, which the process was checkpointed on
        bad = fake_cli(["--action", "restore", "--pid", pid, "--device-map", refused], sim_dir)
        assert (bad.returncode, bad.stderr) == (1, f'Could not restore on process ID {pid}: "invalid argument"\n')
        assert fake_cli(["--get-state", "--pid", pid], sim_dir).stdout == "checkpointed\n"
    assert fake_cli(["--action", "restore", "--pid", pid, "--device-map", "GPU-0=GPU-1"], sim_dir).returncode == 0
    assert fake_cli(["--action", "unlock", "--pid", pid], sim_dir).returncode == 0
    assert wait_for(lambda: proc_state(on_gpu0.pid) != "T")
    # Now on GPU-1 (its environment still says GPU-0): the next restore must map GPU-1, not GPU-0.
    assert fake_cli(["--toggle", "--pid", pid], sim_dir).returncode == 0
    stale = fake_cli(["--action", "restore", "--pid", pid, "--device-map", "GPU-0=GPU-1"], sim_dir)
    assert stale.returncode == 1 and '"invalid argument"' in stale.stderr
    assert fake_cli(["--action", "restore", "--pid", pid, "-d", "GPU-1=GPU-0"], sim_dir).returncode == 0


def test_fake_identity_map_needs_no_gpu_list(sim_dir: Path, on_gpu0: subprocess.Popen[bytes]) -> None:
    """Mapping a GPU onto itself is a plain restore (issue #35: it works where a move did not)."""
    pid = str(on_gpu0.pid)
    assert fake_cli(["--toggle", "--pid", pid], sim_dir).returncode == 0
    assert fake_cli(["--action", "restore", "--pid", pid, "-d", "GPU-0=GPU-0"], sim_dir).returncode == 0


def test_restore_with_a_device_map_passes_it_in_order(tmp_path: Path) -> None:
    """The wrapper sends `--device-map old=new,...` with the restore step only, in the job's order."""
    log = tmp_path / "calls"
    tool = script(tmp_path, "cc", f'echo "$@" >> {log}\ncase "$*" in *--get-state*) echo checkpointed;; esac\n')
    asyncio.run(CudaCheckpoint(tool, timeout_s=10).restore(7, {"GPU-b": "GPU-d", "GPU-a": "GPU-c"}))
    assert log.read_text().splitlines() == ["--get-state --pid 7",
                                            "--action restore --pid 7 --device-map GPU-b=GPU-d,GPU-a=GPU-c",
                                            "--action unlock --pid 7"]
    with pytest.raises(ValueError, match="not a GPU UUID"):
        format_device_map({"GPU-a": "GPU-b,GPU-c"})


def test_a_refused_device_map_is_a_checkpoint_error_that_leaves_it_checkpointed(
        cc: CudaCheckpoint, sim_dir: Path, on_gpu0: subprocess.Popen[bytes]) -> None:
    simcheckpoint.write_gpus(str(sim_dir), {"GPU-0": "H100-80GB", "GPU-2": "A100-80GB"})

    async def go() -> CheckpointError:
        await cc.checkpoint(on_gpu0.pid)
        with pytest.raises(CheckpointError) as failed:
            await cc.restore(on_gpu0.pid, {"GPU-0": "GPU-2"})
        return failed.value

    err = asyncio.run(go())
    assert (err.exit_code, err.cuda_error, err.state) == (1, "invalid argument", "checkpointed")


def test_driver_can_move() -> None:
    assert [driver_can_move(v) for v in ("580.65.06", "595.1", "550.90.07", "", None, "x.1")] == [
        True, True, False, False, False, False]


def test_fake_ignores_a_stale_record_of_a_reused_pid(sim_dir: Path, child: subprocess.Popen[bytes]) -> None:
    sim_dir.mkdir()
    record = sim_dir / f"{child.pid}.json"
    record.write_text('{"state": "checkpointed", "start_time": "1"}')
    assert fake_cli(["--get-state", "--pid", str(child.pid)], sim_dir).stdout == "running\n"
    assert not record.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory owned by another uid")
def test_fake_refuses_a_state_dir_owned_by_someone_else(sim_dir: Path, child: subprocess.Popen[bytes]) -> None:
    sim_dir.mkdir()
    os.chown(sim_dir, 54321, 54321)
    result = fake_cli(["--get-state", "--pid", str(child.pid)], sim_dir)
    assert result.returncode == 1 and "owned by uid 54321" in result.stderr


def test_inject_rejects_unknown_errors(sim_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown CUDA error"):
        simcheckpoint.inject(str(sim_dir), 1, "lock", "CUDA_ERROR_BANANA")


# ---------------------------------------------------------------------------- who may be checkpointed


def test_unsupported_reason() -> None:
    whole = Allocation(devices=[GPU], compute_fraction=1.0)
    assert unsupported_reason(whole, machine="x86_64") is None
    assert unsupported_reason(whole, machine="x86_64", driver_version="570.86.10") is None
    assert "x86-64" in (unsupported_reason(whole, machine="aarch64") or "")
    assert "older than r550" in (unsupported_reason(whole, machine="x86_64", driver_version="535.104.05") or "")
    assert "unreadable" in (unsupported_reason(whole, machine="x86_64", driver_version="n/a") or "")
    assert "no GPU" in (unsupported_reason(None, machine="x86_64") or "")
    mig = Allocation(devices=[MIG], compute_fraction=3 / 7)
    assert "does not support MIG" in (unsupported_reason(mig, machine="x86_64") or "")
    share = Allocation(devices=[GPU], compute_fraction=0.5, share=0.5, gpu_mem_mib=1024)
    assert "shares a GPU" in (unsupported_reason(share, machine="x86_64") or "")
    mps = Allocation(devices=[GPU], compute_fraction=0.5, share=0.5, env={"CUDA_MPS_PIPE_DIRECTORY": "/x"})
    assert "MPS client" in (unsupported_reason(mps, machine="x86_64") or "")
