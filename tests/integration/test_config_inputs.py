"""Bad daemon configuration, found by an input-validation audit (each test failed on the code before
its fix): refused at start with exit 2 naming the key, and by a reload that then changes nothing;
and `[scheduler] backfill = false` must not leave the queue waiting on itself."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from tests.conftest import DaemonProcess, short_tmpdir, wait_until

BASE = 'allow_root_jobs = true\nkill_grace_s = 2.0\ntick_s = 0.2\ncgroup_root = "off"\n'


def cli(sock: str, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "gpusched"), "--socket", sock, *args],
                          capture_output=True, text=True, timeout=timeout)


def start_daemon(config_text: str, sim: str = "H100-80GB:2", wait: float = 8) -> tuple[int | None, str]:
    """Start gpuschedd on `config_text`; (exit status or None if still running after `wait` s, its output)."""
    base = short_tmpdir()
    try:
        cfg = os.path.join(base, "g.toml")
        with open(cfg, "w") as f:
            f.write(config_text)
        proc = subprocess.Popen([sys.executable, "-m", "gpusched.daemon.main", "--config", cfg, "--sim", sim,
                                 "--socket", os.path.join(base, "g.sock"), "--state-dir", os.path.join(base, "st")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=wait)
            return proc.returncode, out
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            return None, out
    finally:
        shutil.rmtree(base, ignore_errors=True)


# docs/config.md: "A file with an unknown key, a value of the wrong type or out of range, or a TOML syntax
# error is refused at start with the file name, the key and the problem".
WRONG_TYPES = {
    "tick_s_string": (BASE.replace("tick_s = 0.2", 'tick_s = "0.2"'), "tick_s"),
    "allow_root_jobs_string": (BASE.replace("allow_root_jobs = true", 'allow_root_jobs = "yes"'), "allow_root_jobs"),
    "max_connections_string": (BASE + 'max_connections = "10"\n', "max_connections"),
    "weight_bool": (BASE + "[fairness]\nweights = { alice = true }\n", "weights"),
}
BAD_LAYOUTS = {  # the daemon starts and only logs "ERROR ... config gpus.N..."
    "unknown_profile": (BASE + '[gpus.0]\nmig = ["9g.99gb"]\n', "gpus.0.mig"),
    "does_not_fit": (BASE + '[gpus.0]\nmig = ["7g.80gb", "1g.10gb"]\n', "gpus.0.mig"),
    "no_such_gpu": (BASE + '[gpus.9]\nmig = "dynamic"\n', "gpus.9"),
}


@pytest.mark.parametrize("case", sorted({**WRONG_TYPES, **BAD_LAYOUTS}))
def test_bad_value_refused_at_start(case: str) -> None:
    text, key = {**WRONG_TYPES, **BAD_LAYOUTS}[case]
    rc, out = start_daemon(text)
    assert rc == 2, f"gpuschedd accepted it (rc={rc}): {out[-800:]}"
    assert key in out and "Traceback" not in out


def test_non_decimal_digit_gpu_key_is_refused_not_a_traceback() -> None:
    """`[gpus."²"]`: str.isdigit() accepts it (config.py _index_keys), int() does not (engine_devices.py:99)."""
    rc, out = start_daemon(BASE + '[gpus."\u00b2"]\nmig = "dynamic"\n')
    assert "Traceback" not in out, out[-1500:]
    assert rc == 2 and "gpus" in out


@pytest.fixture
def proc(daemon_process: Callable[..., DaemonProcess]) -> Iterator[DaemonProcess]:
    p = daemon_process()
    p.start()
    yield p


def test_reload_with_bad_layout_says_why_and_exits_1(proc: DaemonProcess) -> None:
    """docs/admin-guide.md: "A bad file changes nothing. `gpusched admin reload` says why and exits 1." """
    proc.write_config('[gpus.0]\nmig = ["9g.99gb"]\n')
    r = cli(proc.socket, "admin", "reload")
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)


def test_reload_superscript_key_changes_nothing(proc: DaemonProcess) -> None:
    """Today: 'internal error', the new [fairness] is live anyway, and every scheduling pass fails after."""
    proc.write_config('[fairness]\nweights = { alice = 300 }\n[gpus."\u00b2"]\nmig = "dynamic"\n')
    r = cli(proc.socket, "admin", "reload")
    assert r.returncode == 1 and "gpus" in r.stderr, (r.returncode, r.stdout, r.stderr)
    sub = cli(proc.socket, "submit", "--gpus", "1", "--", "/bin/true")
    assert sub.returncode == 0, sub.stderr
    wait_until(lambda: "COMPLETED" in cli(proc.socket, "queue", "--all").stdout, timeout=10,
               what="a job to run after the refused reload")
    proc.write_config("")
    again = cli(proc.socket, "admin", "reload")
    assert "no changes" in again.stdout, again.stdout  # today: "reloaded: gpus, fairness" (it was half-applied)


def test_a_config_that_is_not_a_regular_file_is_refused_at_once(proc: DaemonProcess) -> None:
    """The file was read whole, on the loop, with no limit: a FIFO stalled every client until someone
    wrote to it, and /dev/zero grew the daemon until the kernel killed it (24 GB here)."""
    os.unlink(proc.config_path)
    os.mkfifo(proc.config_path)
    began = time.monotonic()
    reply = cli(proc.socket, "admin", "reload", timeout=30)
    assert reply.returncode == 1 and "not a regular file" in reply.stderr, reply.stderr
    assert time.monotonic() - began < 10
    os.unlink(proc.config_path)
    os.symlink("/dev/zero", proc.config_path)
    reply = cli(proc.socket, "admin", "reload", timeout=30)
    assert reply.returncode == 1 and "not a regular file" in reply.stderr, reply.stderr
    os.unlink(proc.config_path)
    with open(proc.config_path, "w") as f:
        f.write(BASE + "#" * (1 << 20) + "\n")
    reply = cli(proc.socket, "admin", "reload", timeout=30)
    assert reply.returncode == 1 and "larger than 1024 KiB" in reply.stderr, reply.stderr
    assert cli(proc.socket, "queue").returncode == 0  # and it is still serving


def test_backfill_false_does_not_deadlock(daemon_process: Callable[..., DaemonProcess]) -> None:
    """[scheduler] backfill = false (documented key). On 4 GPUs one is kept as interactive headroom; a
    4-GPU head is blocked by it, and the pass stops at the head (core/scheduler.py:265), so the
    interactive job the GPU is kept for is never placed: nothing starts, for ever, with 3-4 GPUs idle."""
    p = daemon_process("H100-80GB:4")
    p.extra_config = "[scheduler]\nbackfill = false\n"
    p.start()
    assert cli(p.socket, "submit", "--gpus", "1", "--name", "first", "--", "/bin/sleep", "2").returncode == 0
    assert cli(p.socket, "submit", "--gpus", "4", "--name", "wide", "--", "/bin/true").returncode == 0
    assert cli(p.socket, "submit", "--gpus", "1", "--class", "interactive", "--name", "inter", "--",
               "/bin/true").returncode == 0
    wait_until(lambda: any(line.split()[1:2] == ["inter"] and "COMPLETED" in line
                           for line in cli(p.socket, "queue", "--all").stdout.splitlines()[1:]),
               timeout=20, what="the interactive job to run on the GPU kept for it")
