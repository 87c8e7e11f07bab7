"""Health events through amdsmi: `AmdSmiEventReader` per enumerated device, read with a timeout.

amdsmi offers a blocking wait: AmdSmiEventReader.read(timeout_ms) polls the devices registered with
amdsmi_init_gpu_event_notification for up to timeout_ms and raises AMDSMI_STATUS_NO_DATA when nothing
came (rocm_smi.cc rsmi_event_notification_get). Its events are VMFAULT, THERMAL_THROTTLE,
GPU_PRE_RESET, GPU_POST_RESET and RING_HANG; none says "GPU lost", so after a quiet wait every device
is probed once and one that fails with GpuLostError is reported as XID 79, lost=True (as the NVML
backend reports a GPU that fell off the bus).

Mapping onto the XID policy of health.py (an XidEvent's `xid` is the NVIDIA number of the closest
meaning, so the same policy applies):
  VMFAULT        -> XID 31 (GPU memory page fault: the application's fault, the device stays in service)
  RING_HANG      -> XID 8  (GPU stopped processing: drain)
  GPU_PRE_RESET  -> XID 8  (the driver resets the GPU, killing its work: drain)
  THERMAL_THROTTLE, GPU_POST_RESET -> not reported (not faults; a drained GPU stays drained until undrained)
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any

from gpusched.gpu.amdsmi_core import STATUS_NO_DATA, AmdSmiCore
from gpusched.gpu.backend import GpuError, GpuLostError, XidEvent

XID_FALLEN_OFF_BUS = 79
AMD_EVENT_XIDS: dict[str, int] = {"VMFAULT": 31, "RING_HANG": 8, "GPU_PRE_RESET": 8}


class EventsMixin(AmdSmiCore):
    """wait_event and close over amdsmi's event readers."""

    _handles: list[Any]  # the devices of the last enumeration, in index order (set by the backend)
    _enumeration: int  # bumped by every re-enumeration

    def _init_events(self) -> None:
        self._readers: list[Any] = []
        self._readers_for = -1
        self._pending: deque[XidEvent] = deque()
        self._lost_reported: set[int] = set()

    def _ensure_readers(self) -> list[Any]:
        with self._lock:
            if self._readers_for != self._enumeration:
                self._stop_readers()
                kinds = [self._smi.AmdSmiEvtNotificationType[name] for name in AMD_EVENT_XIDS]
                for index, h in enumerate(self._handles):
                    try:
                        self._readers.append(self._call("AmdSmiEventReader", h, kinds, what=f"GPU {index}"))
                    except GpuLostError:
                        self._note_lost(index)
                self._readers_for = self._enumeration
            return list(self._readers)

    def _stop_readers(self) -> None:
        for reader in self._readers:
            with contextlib.suppress(Exception):
                reader.stop()
        self._readers = []

    def _note_lost(self, index: int) -> None:
        if index not in self._lost_reported:
            self._lost_reported.add(index)
            self._pending.append(XidEvent(gpu_index=index, xid=XID_FALLEN_OFF_BUS, lost=True))

    def wait_event(self, timeout_ms: int) -> XidEvent | None:
        """The next mapped event (or lost GPU, as XID 79 with lost=True); None after the timeout."""
        if self._closed:
            return None
        readers = self._ensure_readers()
        if self._pending:
            return self._pending.popleft()
        if not readers:
            self._probe_lost()
            return self._pending.popleft() if self._pending else None
        try:
            events = readers[0].read(timeout_ms)  # one read collects the events of every registered device
        except self._smi.AmdSmiLibraryException as err:
            if int(err.get_error_code()) != STATUS_NO_DATA:
                if self._closed:
                    return None
                raise self._map(int(err.get_error_code()), "AmdSmiEventReader.read", "") from err
            self._probe_lost()
            return self._pending.popleft() if self._pending else None
        values = [getattr(h, "value", h) for h in self._handles]
        for ev in events:
            xid = AMD_EVENT_XIDS.get(str(ev.get("event", "")))
            value = getattr(ev.get("processor_handle"), "value", ev.get("processor_handle"))
            if xid is not None and value in values:
                self._pending.append(XidEvent(gpu_index=values.index(value), xid=xid))
        return self._pending.popleft() if self._pending else None

    def _probe_lost(self) -> None:
        """No event says a GPU is gone: ask every device something cheap."""
        for index, h in enumerate(self._handles):
            if index in self._lost_reported:
                continue
            try:
                self._call("amdsmi_get_gpu_device_uuid", h)
            except GpuLostError:
                self._note_lost(index)
            except GpuError:
                continue

    def close(self) -> None:
        """Stop the event readers and shut amdsmi down."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop_readers()
        with contextlib.suppress(GpuError):
            self._call("amdsmi_shut_down")
