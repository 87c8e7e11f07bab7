"""Daemon configuration: TOML file -> pydantic model, with defaults for root and unprivileged runs.

Command-line flags override the file; the file overrides the defaults. A bad file is refused with a
message naming the file, the key and the problem (and the line, where TOML itself could not parse).
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import stat
import tomllib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from gpusched.config_sections import FairnessSection as FairnessSection
from gpusched.config_sections import GpuConfig as GpuConfig
from gpusched.config_sections import MigSection as MigSection
from gpusched.config_sections import SchedulerSection as SchedulerSection
from gpusched.config_sections import ShareModeName as ShareModeName
from gpusched.config_sections import SlurmSection as SlurmSection
from gpusched.protocol import ROOT_SOCKET, user_socket


class ConfigError(Exception):
    """The configuration cannot be used; the message says where and why."""


class DaemonConfig(BaseModel):
    """Everything gpuschedd needs to start. docs/config.md documents every field (python -m gpusched.config_doc)."""

    model_config = ConfigDict(extra="forbid")

    socket: str = Field(description="Unix socket the daemon listens on")
    state_dir: str = Field(description="SQLite database, job directories and logs")
    mode: Literal["standalone", "slurm-node"] = Field(
        default="standalone", description="standalone: gpusched's own queue; slurm-node: Slurm owns the queue, "
        "gpusched keeps the GPU layout and health and drains the node in Slurm on a fault (submit is refused)"
    )
    slurm: SlurmSection = Field(default_factory=SlurmSection, description="Slurm integration (mode = \"slurm-node\")")
    sim: str | None = Field(
        default=None,
        description="simulated GPUs, e.g. \"H100-80GB:2\" or \"GH200-96GB:2,H200:2\"; models: A100-40GB, A100-80GB, "
        "H100-80GB, H100-PCIe, H100-NVL, H200, GH200-96GB, GH200-144GB (NVIDIA, simulated NVML), MI300X, MI325X "
        "(AMD Instinct, simulated amdsmi; each logical GPU is one GPU); one vendor per spec; unset = the real "
        "driver (NVML, else amdsmi)",
    )
    admin_group: str | None = Field(default=None, description="members of this group may act on every job")
    allow_root_jobs: bool = Field(default=False, description="run jobs submitted by root (off: refused)")
    kill_grace_s: float = Field(default=10.0, ge=0.0, le=3600.0, description="SIGTERM -> SIGKILL grace period")
    tick_s: float = Field(default=1.0, gt=0.0, le=60.0, description="housekeeping interval (time limits, charging)")
    launch_timeout_s: float = Field(
        default=30.0, gt=0.0, le=3600.0, description="a job not exec'd this long after its launch began is "
        "killed and ends FAILED (its user controls that time)"
    )
    checkpoint: bool = Field(
        default=True, description="preempt whole-GPU jobs by checkpointing them with cuda-checkpoint (driver r550+; "
        "simulated on --sim) so they lose no work, when the program is available; off: preemption only requeues "
        "--requeue jobs"
    )
    checkpoint_moves: Literal["auto"] | bool = Field(
        default="auto", description="a checkpointed job may be restored on another free GPU of the same model "
        "(cuda-checkpoint --device-map, driver r580+) instead of waiting for its own: true, false, or \"auto\" "
        "(on when the driver is r580 or later; simulated GPUs report r550, so off on --sim)"
    )
    checkpoint_binary: str | None = Field(
        default=None, max_length=4096, description="the cuda-checkpoint program (default: `cuda-checkpoint` in PATH; "
        "the simulated one on --sim)"
    )
    checkpoint_timeout_s: float = Field(
        default=30.0, gt=0.0, le=3600.0, description="deadline of each cuda-checkpoint run; a checkpoint that passes "
        "it is rolled back and the job runs on"
    )
    launcher: Literal["forkserver", "spawn"] = Field(
        default="forkserver", description="how each job's supervisor (shim) starts: \"forkserver\" forks it from "
        "a warm process the daemon starts once (about 1 ms; falls back to spawning when that process is gone), "
        "\"spawn\" starts a fresh Python interpreter per job (tens of ms)"
    )
    max_connections: int = Field(default=1024, ge=1, le=65536, description="concurrent client connections")
    client_idle_timeout_s: float = Field(
        default=600.0, gt=0, le=86400, description="close a connection that sends no request for this long after "
        "hello (before hello the limit is 10 s); `top` streams and long polls are not idle. Read deadlines are "
        "checked by one ticker every quarter of the shortest limit (at most 1 s), so a limit fires up to that much "
        "late"
    )
    client_read_timeout_s: float = Field(
        default=30.0, gt=0, le=3600, description="a frame must arrive whole within this long of its first byte, "
        "and a client must take each reply within it, or the connection is closed"
    )
    max_pending_per_user: int = Field(
        default=50000, ge=1, description="pending and held jobs one user may have; more submits are refused"
    )
    max_array_size: int = Field(
        default=10001, ge=1, le=1_000_000, description="most tasks one job array (`submit --array`) may have; each "
        "task also counts against max_pending_per_user"
    )
    max_pending_bytes_per_user: int = Field(
        default=256 * 2**20, ge=0, description="bytes of argv, environment, cwd and name (as the 256 KiB per-job cap "
        "counts them) one user's pending and held jobs may take together; the daemon holds these jobs in memory"
    )
    submit_rate_per_user: float = Field(
        default=200.0, gt=0, description="sustained submits per second one user may make (bursts up to 10x "
        "this are allowed); root is exempt"
    )
    finished_job_retention_s: float = Field(
        default=7 * 86400.0, ge=0, description="finished jobs (their records, histories and logs) are deleted this "
        "long after they ended; `queue --all`, `show` and `stats` see what is kept"
    )
    max_finished_jobs: int = Field(
        default=10_000, ge=0, description="keep at most this many finished jobs, the newest (the last to end); "
        "older ones are deleted even within finished_job_retention_s"
    )
    gpus: dict[str, GpuConfig] = Field(default_factory=dict, description="per-GPU settings keyed by GPU index")
    fairness: FairnessSection = Field(default_factory=FairnessSection, description="fair-share weights and quanta")
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection, description="backfill and preemption")
    mig: MigSection = Field(default_factory=MigSection, description="dynamic MIG damping")
    mps_control: str | None = Field(
        default=None, description="path of nvidia-cuda-mps-control; unset: the one on PATH (simulated GPUs: "
        "gpusched's simulated control program)"
    )
    health_auto_resume_s: float | None = Field(
        default=None, gt=0, description="resume a device drained by an XID after this many quiet seconds; "
        "unset: only `gpusched gpus resume` brings it back"
    )
    cgroup_root: str = Field(
        default="auto",
        description="delegated cgroup v2 directory for per-job cgroups; \"auto\" uses the service's own cgroup "
        "when systemd delegated it (Delegate=yes), \"off\" disables cgroups (CPU affinity only)",
    )
    cuda_device_max_connections: int | None = Field(
        default=None, ge=1, le=32, description="CUDA_DEVICE_MAX_CONNECTIONS given to every job when set"
    )
    job_mapping_dir: str | None = Field(
        default=None, description="write dcgm-exporter HPC job-mapping files here (its --hpc-job-mapping-dir)"
    )
    # metrics_allow_remote comes before metrics_address so the address validator can see it.
    metrics_allow_remote: bool = Field(
        default=False, description="allow metrics_address to listen on a non-loopback address (no authentication!)"
    )
    metrics_address: str | None = Field(
        default=None,
        description="serve Prometheus metrics over HTTP at HOST:PORT, e.g. \"127.0.0.1:9490\"; unset = off",
    )
    metrics_max_connections: int = Field(
        default=32, ge=1, le=1024, description="concurrent connections to the metrics endpoint; more are closed at "
        "once, so a flood there cannot take the descriptors the control socket needs"
    )

    @field_validator("gpus")
    @classmethod
    def _index_keys(cls, value: dict[str, GpuConfig]) -> dict[str, GpuConfig]:
        for key in value:
            if not (key.isascii() and key.isdecimal()):  # (str.isdigit takes "²", which int() does not)
                raise ValueError(f"GPU keys must be GPU indices like \"0\", not {key!r}")
        return value

    @field_validator("gpus")
    @classmethod
    def _no_dynamic_mig_under_slurm(cls, value: dict[str, GpuConfig], info: ValidationInfo) -> dict[str, GpuConfig]:
        # Slurm's gres.conf must match the layout; a layout that changes by itself would not.
        if info.data.get("mode") == "slurm-node":
            for key, gpu in value.items():
                if gpu.mig == "dynamic":
                    raise ValueError(f'gpus.{key}.mig = "dynamic" cannot be used with mode = "slurm-node": Slurm\'s '
                                     "gres.conf must match the layout; give a fixed list and change it with "
                                     "`gpusched slurm relayout`")
        return value

    @field_validator("checkpoint_moves", mode="before")
    @classmethod
    def _moves_switch(cls, value: object) -> object:
        # TOML has real booleans: anything but true, false or "auto" is a mistake, not a spelling of one.
        if value is True or value is False or value == "auto":
            return value
        raise ValueError(f'must be true, false or "auto", not {value!r}')

    @field_validator("metrics_address")
    @classmethod
    def _metrics_address(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        host, _ = split_host_port(value)
        if not info.data.get("metrics_allow_remote", False) and not is_loopback(host):
            raise ValueError(
                f"{host!r} is not a loopback address; metrics have no authentication, so serve them on "
                "127.0.0.1 or ::1, or set metrics_allow_remote = true"
            )
        return value

    @property
    def db_path(self) -> str:
        return os.path.join(self.state_dir, "gpusched.db")

    @property
    def jobs_dir(self) -> str:
        return os.path.join(self.state_dir, "jobs")


def split_host_port(address: str) -> tuple[str, int]:
    """`127.0.0.1:9490`, `[::1]:9490` or `localhost:9490` -> (host, port); ValueError if malformed."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT (e.g. \"127.0.0.1:9490\" or \"[::1]:9490\")")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{address!r}: write an IPv6 address in brackets, e.g. \"[::1]:9490\"")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{address!r}: port {port} is out of range (0-65535; 0 picks a free port)")
    return host, port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


def _home_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_dir
    except KeyError:
        return f"/tmp/gpusched-{uid}"  # (no home at all: checked at start, as every state directory is)


def default_paths(uid: int, env: Mapping[str, str]) -> dict[str, str]:
    """Root gets the system paths; anyone else gets per-user paths so no privilege is needed."""
    if uid == 0:
        return {"socket": ROOT_SOCKET, "state_dir": "/var/lib/gpusched"}
    # (no $HOME: the passwd entry's home, never a directory under /tmp another user may make first)
    state_home = env.get("XDG_STATE_HOME") or os.path.join(env.get("HOME") or _home_of(uid), ".local", "state")
    return {"socket": user_socket(uid, env), "state_dir": os.path.join(state_home, "gpusched")}


def read_config_text(path: str) -> str:
    """A config file's text: a regular file (a FIFO would block the reader, a device never end), at
    most MAX_CONFIG_BYTES. Raises ConfigError for those, OSError / UnicodeDecodeError as reading does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # (a FIFO must not block the open)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path}: not a regular file")
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
        while len(data) <= MAX_CONFIG_BYTES and (more := os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))):
            data += more
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES // 1024} KiB; is it the config file?")
    return data.decode("utf-8")


def load_config(
    path: str | None,
    overrides: Mapping[str, Any] | None = None,
    *,
    uid: int | None = None,
    env: Mapping[str, str] | None = None,
) -> DaemonConfig:
    """Defaults, then the TOML file at `path`, then non-None `overrides` (command-line flags)."""
    data: dict[str, Any] = default_paths(os.getuid() if uid is None else uid, os.environ if env is None else env)
    source = "command line"
    if path is not None:
        source = path
        data.update(_read_toml(path))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        # strict: "0.5" for a number, "yes" or 1 for a flag, true for a weight are refused, not guessed at
        return DaemonConfig.model_validate(data, strict=True)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid configuration: {describe_errors(exc)}") from None


def describe_errors(exc: ValidationError) -> str:
    """`key.path: problem` for each error, joined: what a config error message lists."""
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors())


MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KiB; /dev/zero or a log named by mistake is not one


def _read_toml(path: str) -> dict[str, Any]:
    try:
        text = read_config_text(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
