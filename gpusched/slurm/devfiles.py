"""Device nodes for simulated GPUs: Slurm refuses a plain file for `File=`, so we `mknod` them.

Real nodes have /dev/nvidiaN and /dev/nvidia-caps/nvidia-capN from the driver; with `--sim` there
is no driver, so export creates character devices with the driver's numbers under a directory of
its own (never /dev). Nothing opens them: Slurm only stats them and, with ConstrainDevices, puts
their numbers in the job's device cgroup.
"""

from __future__ import annotations

import os
import re
import stat

from gpusched.slurm.gresconf import GresDevice

NVIDIA_MAJOR = 195  # /dev/nvidiaN
NVIDIA_CAPS_MAJOR = 236  # dynamic on a real system (see /proc/devices, "nvidia-caps"); fixed here

_GPU = re.compile(r"/nvidia([0-9]+)$")
_CAP = re.compile(r"/nvidia-caps/nvidia-cap([0-9]+)$")


def device_number(path: str) -> tuple[int, int]:
    """(major, minor) of one of our device paths; ValueError for anything else."""
    if m := _GPU.search(path):
        return NVIDIA_MAJOR, int(m.group(1))
    if m := _CAP.search(path):
        return NVIDIA_CAPS_MAJOR, int(m.group(1))
    raise ValueError(f"not an NVIDIA device path: {path}")


def make_device_files(devs: list[GresDevice], dev_root: str) -> list[str]:
    """Create the character devices `devs` name under `dev_root` (root only); returns those created.

    An existing character device with the right numbers is kept; anything else there is an error,
    so a typo in --dev-root cannot replace files in a directory that is not ours.
    """
    created: list[str] = []
    for path in sorted({f for d in devs for f in d.files}):
        if not path.startswith(dev_root.rstrip("/") + "/"):
            raise ValueError(f"{path} is outside {dev_root}")
        major, minor = device_number(path)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            try:
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            except PermissionError:
                raise PermissionError(f"mknod {path}: only root can create device files "
                                      "(run `gpusched slurm export` as root)") from None
            created.append(path)
            continue
        if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (major, minor):
            raise ValueError(f"{path} exists and is not character device {major}:{minor}")
    return created
