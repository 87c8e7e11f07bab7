"""All of a node's MPS control daemons: one per device (and user), started and quit as shares
come and go, with one start or stop at a time per daemon (gpu/mps.py is one daemon)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from gpusched.gpu.backend import GpuError
from gpusched.gpu.mps import DEFAULT_CONTROL_BINARY, MpsDaemon

# What a user's control daemon on a device should cap each client at: (thread percentage, MiB; MiB
# None: no memory cap), or None when that user has no share there any more; read when set.
Caps: TypeAlias = Callable[[], "tuple[int, int | None] | None"]


class MpsManager:
    """All MPS daemons of the node, keyed by device UUID and (for per-user daemons) uid."""

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        control_binary: str = DEFAULT_CONTROL_BINARY,
        timeout_s: float = 10.0,
    ) -> None:
        self.base_dir = Path(base_dir)
        self.control_binary = control_binary
        self.timeout_s = timeout_s
        self._daemons: dict[tuple[str, int | None], MpsDaemon] = {}
        self._lock = threading.Lock()
        # One start or stop at a time per (device, uid): a stop still waiting for its daemon to quit
        # made a start beside it find the quitting daemon "running", and the share ran with none.
        self._key_locks: dict[tuple[str, int | None], threading.Lock] = {}

    def _key_lock(self, device: str, uid: int | None) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault((device, uid), threading.Lock())

    def daemon(self, device: str, uid: int | None = None) -> MpsDaemon:
        """The (possibly not yet started) daemon for a device (and user)."""
        with self._lock:
            key = (device, uid)
            if key not in self._daemons:
                self._daemons[key] = MpsDaemon(
                    device, self.base_dir, uid=uid, control_binary=self.control_binary, timeout_s=self.timeout_s
                )
            return self._daemons[key]

    def ensure(
        self, device: str, uid: int | None = None, *, default_thread_percentage: int | None = None,
        pinned_mem_limit_mib: int | None = None, caps: Caps | None = None,
    ) -> MpsDaemon:
        """Start the daemon if it is not running; then, with `caps`, set the caps it gives now."""
        with self._key_lock(device, uid):
            d = self.daemon(device, uid)
            d.start(default_thread_percentage=default_thread_percentage, pinned_mem_limit_mib=pinned_mem_limit_mib)
            if caps is not None:
                self._set_caps(d, caps)
            return d

    def update_caps(self, device: str, uid: int | None, caps: Caps) -> None:
        """Set the caps of a running daemon again (a share beside it ended); none running: nothing."""
        with self._key_lock(device, uid):
            with self._lock:
                d = self._daemons.get((device, uid))
            if d is not None and d.running():
                self._set_caps(d, caps)

    @staticmethod
    def _set_caps(d: MpsDaemon, caps: Caps) -> None:
        # Read under the key's lock, at the moment they are set: of two updates racing from
        # different threads, the one that sets last reads last, so the caps end current.
        values = caps()
        if values is not None:
            d.set_caps(*values)

    def quit_strays(self) -> int:
        """Quit every control daemon under the base directory that no registered daemon (see
        `daemon`) owns, as a restarted gpuschedd must once it has registered the ones its running
        shares use: the others' shares ended while no one was there to quit them. Returns how many
        were told to quit; raises the first GpuError after trying them all."""
        with self._lock:
            owned = {d.root for d in self._daemons.values()}
        told = 0
        errors: list[GpuError] = []
        for root in sorted(self.base_dir.glob("*")) if self.base_dir.is_dir() else ():
            if root in owned or root.is_symlink() or not root.is_dir():
                continue
            stray = MpsDaemon.found_at(root, control_binary=self.control_binary, timeout_s=self.timeout_s)
            if stray.running():
                try:
                    stray.stop()
                except GpuError as err:
                    errors.append(err)
                    continue
                told += 1
        if errors:
            raise errors[0]
        return told

    def stop(self, device: str, uid: int | None = None, *, still_idle: Callable[[], bool] | None = None) -> None:
        """Quit the daemon; with `still_idle`, only if it still says so once no start is under way
        (a share starting for the same user and device meanwhile keeps it)."""
        with self._key_lock(device, uid):
            if still_idle is not None and not still_idle():
                return
            with self._lock:
                d = self._daemons.pop((device, uid), None)
            if d is not None:
                d.stop()

    def stop_all(self) -> list[GpuError]:
        """Stop every daemon; returns the errors instead of stopping at the first."""
        errors: list[GpuError] = []
        with self._lock:
            daemons = list(self._daemons.values())
            self._daemons.clear()
        for d in daemons:
            try:
                d.stop()
            except GpuError as err:
                errors.append(err)
        return errors

    def devices(self) -> list[str]:
        """Devices with at least one daemon."""
        with self._lock:
            return sorted({device for device, _ in self._daemons})

    def servers(self) -> list[tuple[str, int | None]]:
        """(device, uid) of every daemon; uid None for a device-wide one."""
        with self._lock:
            return list(self._daemons)
