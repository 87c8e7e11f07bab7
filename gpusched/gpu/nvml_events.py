"""XID events and lost GPUs through NVML: one event set, registered per GPU as GPUs answer; a GPU
that falls off the bus is reported once, as XID 79 with `lost=True`."""

from __future__ import annotations

from typing import Any

from gpusched.gpu.backend import (
    GpuError,
    GpuLostError,
    GpuNotSupportedError,
    XidEvent,
)
from gpusched.gpu.nvml_core import NO_ID, XID_FALLEN_OFF_BUS, NvmlCore


class EventsMixin(NvmlCore):
    """Event waits, lost-GPU probing, and shutdown."""

    # ------------------------------------------------------------------ events

    def _ensure_events(self) -> Any:
        with self._lock:
            if self._event_set is None:
                self._event_set = self._call("nvmlEventSetCreate")
            xid = int(self._nvml.nvmlEventTypeXidCriticalError)
            for index in range(int(self._call("nvmlDeviceGetCount"))):
                if index in self._registered or index in self._lost_reported:
                    continue
                try:
                    h = self._handle(index)
                    supported = int(self._call("nvmlDeviceGetSupportedEventTypes", h))
                    if supported & xid:
                        self._call("nvmlDeviceRegisterEvents", h, xid, self._event_set)
                    self._registered.add(index)
                except GpuLostError:
                    self._note_lost(index)
                except GpuNotSupportedError:
                    self._registered.add(index)  # no XID events on this GPU; do not retry forever
            return self._event_set

    def _note_lost(self, index: int) -> None:
        if index not in self._lost_reported:
            self._lost_reported.add(index)
            self._pending_lost.append(index)

    def wait_event(self, timeout_ms: int) -> XidEvent | None:
        """The next critical XID (or lost GPU, as XID 79 with lost=True); None after the timeout."""
        if self._closed:
            return None
        es = self._ensure_events()
        with self._lock:
            if self._pending_lost:
                return XidEvent(gpu_index=self._pending_lost.popleft(), xid=XID_FALLEN_OFF_BUS, lost=True)
        try:
            data = self._call("nvmlEventSetWait", es, timeout_ms)
        except GpuLostError:
            return self._find_lost()
        except GpuError as err:
            if self._closed:
                return None
            if int(getattr(err.__cause__, "value", -1)) == int(self._nvml.NVML_ERROR_TIMEOUT):
                return None
            raise
        index = int(self._call("nvmlDeviceGetIndex", data.device))
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        return XidEvent(
            gpu_index=index,
            xid=int(data.eventData),
            gi_id=None if gi == NO_ID else gi,
            ci_id=None if ci == NO_ID else ci,
        )

    def _find_lost(self) -> XidEvent | None:
        """The wait said GPU_IS_LOST without saying which GPU: probe them all."""
        count = int(self._call("nvmlDeviceGetCount"))
        with self._lock:
            for index in range(count):
                try:
                    self._call("nvmlDeviceGetUUID", self._handle(index))
                except GpuLostError:
                    self._note_lost(index)
                except GpuError:
                    continue
            if self._pending_lost:
                return XidEvent(gpu_index=self._pending_lost.popleft(), xid=XID_FALLEN_OFF_BUS, lost=True)
        raise GpuLostError("event wait reported a lost GPU, but every GPU still answers")

    def close(self) -> None:
        """Free the event set and shut NVML down (pynvml's init is reference counted)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            es, self._event_set = self._event_set, None
        if es is not None:
            self._call_opt("nvmlEventSetFree", es, none_on=(GpuError,))
        self._call_opt("nvmlShutdown", none_on=(GpuError,))
