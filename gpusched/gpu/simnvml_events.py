"""The simulated event sets: register per GPU, wait (XIDs delivered once, lost GPUs, timeouts), free."""

from __future__ import annotations

import time
from typing import Any

from gpusched.gpu.simnvml_state import (
    SimCore,
    _api,
    _EventSet,
    _handle_addr,
    _MigDevice,
)


class EventsMixin(SimCore):
    """The simulated event sets: register per GPU, wait (XIDs delivered once, lost GPUs, timeouts), free."""

    # ------------------------------------------------------------------ events

    @_api
    def nvmlEventSetCreate(self) -> Any:
        es = _EventSet()
        es.handle = self._new_handle(self._nv.struct_c_nvmlEventSet_t, es)
        self._event_sets.append(es)
        return es.handle

    def _event_set(self, handle: Any) -> _EventSet:
        addr = _handle_addr(handle)
        es = self._objs.get(addr) if addr is not None else None
        if not isinstance(es, _EventSet) or not es.alive:
            self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
        return es

    @_api
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._gpu(handle)
        return self._supported_events()

    @_api
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        dev = self._device(handle)
        if isinstance(dev, _MigDevice):
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)  # events are registered on the parent GPU only
        es = self._event_set(eventSet)
        if eventTypes & ~self._supported_events():
            self._fail(self._nv.NVML_ERROR_NOT_SUPPORTED)
        es.masks[dev.index] = es.masks.get(dev.index, 0) | eventTypes

    @_api
    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        """Block up to `timeoutms` for the next event; TIMEOUT when none, GPU_IS_LOST once per loss."""
        es = self._event_set(eventSet)
        deadline = time.monotonic() + max(0, timeoutms) / 1000.0
        while True:
            if not es.alive:
                self._fail(self._nv.NVML_ERROR_INVALID_ARGUMENT)
            if es.lost:
                es.lost.popleft()
                self._fail(self._nv.NVML_ERROR_GPU_IS_LOST)
            if es.queue:
                gpu, etype, edata, gi_id, ci_id = es.queue.popleft()
                data = self._nv.c_nvmlEventData_t()
                data.device = gpu.handle
                data.eventType = etype
                data.eventData = edata
                data.gpuInstanceId = gi_id
                data.computeInstanceId = ci_id
                return data
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(self._nv.NVML_ERROR_TIMEOUT)
            self._cond.wait(remaining)

    nvmlEventSetWait = nvmlEventSetWait_v2

    @_api
    def nvmlEventSetFree(self, eventSet: Any) -> None:
        es = self._event_set(eventSet)
        es.alive = False
        self._event_sets.remove(es)
        self._cond.notify_all()
