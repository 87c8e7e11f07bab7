"""dcgm-exporter HPC job-mapping files, so GPU metrics can be labelled with the job using them.

dcgm-exporter's `--hpc-job-mapping-dir` (or DCGM_HPC_JOB_MAPPING_DIR) reads one file per device:
named by the GPU index (`0`, `1`, ...) or, for a MIG device, `GPU.GI` (e.g. `2.1`, GPU 2's GPU
instance 1), each holding the ids of the jobs on that device, one per line (dcgm-exporter README,
"Include HPC Job Information in Metric Labels"). We rewrite the directory whenever an allocation
changes; each file is replaced atomically so the exporter never reads half a file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterable, Mapping

from gpusched.gpu.backend import Gpu
from gpusched.model import Job


def device_file_names(gpus: Iterable[Gpu]) -> dict[str, str]:
    """Device UUID -> mapping-file name: `INDEX` for a GPU, `INDEX.GI` for a MIG instance."""
    names: dict[str, str] = {}
    for gpu in gpus:
        names[gpu.uuid] = str(gpu.index)
        for inst in gpu.instances:
            names[inst.uuid] = f"{gpu.index}.{inst.gi_id}"
    return names


def job_mapping(gpus: Iterable[Gpu], jobs: Iterable[Job]) -> dict[str, list[int]]:
    """File name -> job ids, for every job that holds a device."""
    names = device_file_names(gpus)
    mapping: dict[str, list[int]] = {}
    for job in jobs:
        if job.allocation is None:
            continue
        for uuid in job.allocation.uuids:
            if uuid in names:
                mapping.setdefault(names[uuid], []).append(job.id)
    return mapping


_MAPPING_NAME = re.compile(r"^[0-9]+(\.[0-9]+)?$")  # the only names we ever write, and so ever delete


def write_job_mapping(directory: str, mapping: Mapping[str, list[int]]) -> None:
    """Make `directory` hold exactly `mapping`: changed files replaced, stale ones removed.

    Root writes here, so nothing in the path may be a user's: the directory is reached one component
    at a time with O_NOFOLLOW from `/`, every component must belong to root (or the daemon's user)
    and be writable by nobody else (sticky directories such as /tmp excepted), and files are created
    with O_EXCL|O_NOFOLLOW relative to the directory's descriptor. Raises OSError (with the reason)
    for a directory that fails these checks; nothing is written then.
    """
    fd = open_private_dir(directory)
    try:
        for name, job_ids in mapping.items():
            if not _MAPPING_NAME.match(name):
                raise OSError(errno.EINVAL, f"not a mapping file name: {name!r}")
            content = "".join(f"{j}\n" for j in sorted(job_ids)).encode()
            if _read_regular(fd, name) == content:
                continue
            tmp = f".{name}.tmp"
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(tmp, dir_fd=fd)  # a leftover of ours (only root can write here)
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
            try:
                os.write(out, content)
                os.fchmod(out, 0o644)
            finally:
                os.close(out)
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        for name in os.listdir(fd):
            if name not in mapping and _MAPPING_NAME.match(name):
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def open_private_dir(directory: str) -> int:
    """A descriptor of `directory` (created 0755 where missing), after checking that no other user
    can change what it holds. See write_job_mapping."""
    if not os.path.isabs(directory):
        raise OSError(errno.EINVAL, f"{directory}: job_mapping_dir must be an absolute path")
    me = os.geteuid()
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    path = "/"
    try:
        parts = [p for p in os.path.normpath(directory).split("/") if p]
        for i, part in enumerate(parts):
            path = os.path.join(path, part)
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                child = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(exc.errno, f"{path} is a symbolic link or not a directory; refusing to "
                                  "write job mapping files through it") from None
                raise
            os.close(fd)
            fd = child
            info = os.fstat(fd)
            if info.st_uid not in (0, me):
                raise OSError(errno.EPERM, f"{path} belongs to uid {info.st_uid}, not root; refusing to write "
                              "job mapping files there")
            others_write = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            if others_write and (last or not info.st_mode & stat.S_ISVTX):
                raise OSError(errno.EPERM, f"{path} is writable by other users (mode "
                              f"{stat.S_IMODE(info.st_mode):04o}); refusing to write job mapping files there")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_regular(dir_fd: int, name: str) -> bytes | None:
    """The content of a regular file `name` in the directory, or None (missing, a link, a FIFO, ...)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, 1 << 20)
    finally:
        os.close(fd)
