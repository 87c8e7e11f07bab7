"""Handlers of requests about the node: GPUs and their health, MIG layouts, the live `top` stream,
stats, doctor, reload and shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gpusched.config import ConfigError
from gpusched.core.accounting import UserStats, device_busy_fraction, fairness_index, user_stats
from gpusched.daemon.devices import DeviceError, amd_simulator_of, simulator_of
from gpusched.daemon.doctor import run_checks
from gpusched.daemon.handlers_common import (
    Context,
    _health,
    _read,
    _require_admin,
)
from gpusched.daemon.launch import gpu_memory_by_job
from gpusched.daemon.store import StoreReader
from gpusched.gpu.backend import Gpu, GpuError
from gpusched.gpu.simamdsmi import SimAmdSmi
from gpusched.model import (
    ACTIVE_STATES,
    Job,
    JobState,
    describe_request,
)
from gpusched.protocol import (
    DevicesChanged,
    DeviceStatsInfo,
    DoctorRequest,
    DoctorResult,
    ErrorCode,
    GpuDrainRequest,
    GpuInfo,
    GpuResumeRequest,
    GpusRequest,
    GpusResult,
    InstanceInfo,
    MigApplyRequest,
    MigApplyResult,
    PartitionInfo,
    PlannedInstance,
    ProtocolError,
    ReloadRequest,
    ReloadResult,
    ShutdownRequest,
    ShutdownResult,
    SimInjectXidRequest,
    SimResult,
    StatsRequest,
    StatsResult,
    TopJob,
    TopSnapshot,
    TopUser,
    UserStatsInfo,
    WatchRequest,
)


def gpu_drain(ctx: Context, req: GpuDrainRequest) -> DevicesChanged:
    _require_admin(ctx, "drain devices")
    reason = f"drained by {ctx.user}" + (f": {req.reason}" if req.reason else "")
    try:
        drained = ctx.engine.drain(req.device, reason)
    except DeviceError as exc:
        raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None
    message = f"{len(drained)} device(s) drained; running jobs continue, no new job starts there"
    return DevicesChanged(devices=drained, message=message if drained else "already drained")


def gpu_resume(ctx: Context, req: GpuResumeRequest) -> DevicesChanged:
    _require_admin(ctx, "resume devices")
    try:
        resumed = ctx.engine.resume_device(req.device, ctx.user)
    except DeviceError as exc:
        raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None
    return DevicesChanged(devices=resumed, message=f"{len(resumed)} device(s) back in service" if resumed
                          else "not drained")


async def mig_apply(ctx: Context, req: MigApplyRequest) -> MigApplyResult:
    _require_admin(ctx, "change MIG layouts")
    if not any(g.index == req.gpu for g in ctx.engine.inventory.gpus):  # as `gpus drain`: not found (exit 4)
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no GPU {req.gpu}",
                            f"this node has GPUs {', '.join(str(g.index) for g in ctx.engine.inventory.gpus)}")
    try:
        change, done = await ctx.engine.apply_mig_layout(req.gpu, req.layout, req.dry_run)
    except DeviceError as exc:
        raise ProtocolError(ErrorCode.INVALID_STATE, str(exc)) from None
    except GpuError as exc:
        raise ProtocolError(ErrorCode.INTERNAL, f"GPU {req.gpu}: {exc.message}", exc.hint) from None
    if change.error is not None:
        raise ProtocolError(ErrorCode.INVALID_STATE, change.error, "nothing was changed")
    return MigApplyResult(
        gpu=req.gpu, keep=list(change.keep), destroy=list(change.destroy),
        create=[PlannedInstance(profile=p, start=st) for p, st in change.create], applied=not req.dry_run, log=done,
    )


def sim_inject_xid(ctx: Context, req: SimInjectXidRequest) -> SimResult:
    _require_admin(ctx, "inject faults")
    sim = simulator_of(ctx.engine.backend)
    amd = amd_simulator_of(ctx.engine.backend)
    if amd is not None:
        return _inject_amd(ctx, amd, req)
    if sim is None:
        raise ProtocolError(ErrorCode.INVALID_STATE, "this daemon drives real GPUs; faults can only be "
                            "injected into simulated ones (gpuschedd --sim)")
    if not any(g.index == req.gpu for g in ctx.engine.inventory.gpus):
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no GPU {req.gpu}")
    if req.lost:
        sim.lose_gpu(req.gpu)
        return SimResult(message=f"GPU {req.gpu} fell off the bus")
    sim.inject_xid(req.gpu, req.xid, req.gi, req.ci)
    scope = f" (GI {req.gi}" + (f", CI {req.ci}" if req.ci is not None else "") + ")" if req.gi is not None else ""
    return SimResult(message=f"XID {req.xid} injected on GPU {req.gpu}{scope}")


# The amdsmi event a simulated AMD GPU raises for an XID (the backend maps them back, docs/gpu.md).
_AMD_EVENTS = {31: "VMFAULT", 8: "RING_HANG"}


def _inject_amd(ctx: Context, sim: SimAmdSmi, req: SimInjectXidRequest) -> SimResult:
    """On simulated AMD GPUs faults are amdsmi events of the logical GPU's partition, or the loss of
    its whole physical GPU (every partition falls off the bus with it)."""
    gpu = next((g for g in ctx.engine.inventory.gpus if g.index == req.gpu), None)
    if gpu is None:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no GPU {req.gpu}")
    physical = gpu.partition.physical_index if gpu.partition is not None else req.gpu
    partition = gpu.partition.index_in_physical if gpu.partition is not None else 0
    if req.lost:
        sim.lose_gpu(physical)
        return SimResult(message=f"physical GPU {physical} (GPU {req.gpu} and its sibling partitions) fell off the bus")
    event = _AMD_EVENTS.get(req.xid)
    if event is None or req.gi is not None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"simulated AMD GPUs raise amdsmi events, not XID {req.xid}"
                            + (" with a GI" if req.gi is not None else ""),
                            "use XID 31 (VMFAULT) or 8 (RING_HANG), or --lost; AMD GPUs have no MIG instances")
    sim.inject_event(physical, partition, event)
    return SimResult(message=f"{event} (as XID {req.xid}) injected on GPU {req.gpu}")


async def watch(ctx: Context, req: WatchRequest) -> AsyncIterator[TopSnapshot]:
    """Push a snapshot now and after every change (coalesced to `max_rate_hz`), for `gpusched top`."""
    engine = ctx.engine
    loop = asyncio.get_running_loop()
    seq = 0
    while not engine.shutting_down:
        seq += 1
        yield await _top_snapshot(ctx, seq, req.max_pending)
        sent = loop.time()
        await engine.wait_for_change(2.0)  # a heartbeat at least every 2 s keeps runtimes moving
        await asyncio.sleep(max(0.0, 1.0 / req.max_rate_hz - (loop.time() - sent)))


async def _top_snapshot(ctx: Context, seq: int, max_pending: int) -> TopSnapshot:
    engine = ctx.engine
    jobs = sorted(engine.jobs.values(), key=lambda j: j.id)
    active = [j for j in jobs if j.state in ACTIVE_STATES]
    pending = [j for j in jobs if j.state in (JobState.PENDING, JobState.HELD)]
    memory = await asyncio.to_thread(gpu_memory_by_job, engine.backend, active, engine.cgroups)
    standing = engine.scheduler.export_standing() if hasattr(engine.scheduler, "export_standing") else {}
    counts: dict[str, list[int]] = {}  # user -> [running, pending, next pending job id]
    for job in jobs:
        row = counts.setdefault(job.user, [0, 0, 0])
        if job.state in ACTIVE_STATES:
            row[0] += 1
        elif job.state is JobState.PENDING:
            row[1] += 1
            row[2] = row[2] or job.id
    users = [
        TopUser(user=user, weight=engine.weight_of(user), running=r, pending=p,
                service_gpu_h=standing.get(user, {}).get("service", 0.0) / 3600,
                lag_gpu_s=standing[user]["lag"] if user in standing else None, next_job=nxt or None)
        for user, (r, p, nxt) in sorted(counts.items()) if r or p
    ]
    return TopSnapshot(
        seq=seq, now=engine.clock(), gpus=gpus(ctx, GpusRequest()).gpus,
        running=[_top_job(j, memory.get(j.id)) for j in active],
        pending=[_top_job(j, None) for j in pending[:max_pending]], pending_total=len(pending),
        users=users, events=engine.store.events(limit=20),
    )


def _top_job(job: Job, gpu_mem_mib: int | None) -> TopJob:
    return TopJob(id=job.id, name=job.display_name, user=job.user, state=job.state,
                  request=describe_request(job.spec.request),
                  devices=job.allocation.uuids if job.allocation is not None else [],
                  submitted_at=job.submitted_at, started_at=job.started_at, gpu_mem_mib=gpu_mem_mib)


async def stats(ctx: Context, req: StatsRequest) -> StatsResult:
    engine = ctx.engine
    now = engine.clock()
    since = now - req.since_s

    def figures(reader: StoreReader) -> tuple[list[UserStats], dict[str, float]]:
        jobs = reader.jobs_touching(since, with_spec=False)  # accounting needs times and allocations only
        return user_stats(jobs, since, now, engine.weight_of), device_busy_fraction(jobs, since, now)

    users, busy = await _read(ctx, figures)
    devices = []
    for gpu in engine.inventory.gpus:
        if not gpu.mig_enabled:
            devices.append(DeviceStatsInfo(gpu=gpu.index, uuid=gpu.uuid, kind="gpu", profile=None,
                                           busy_fraction=min(1.0, busy.get(gpu.uuid, 0.0))))
        for inst in gpu.instances:
            devices.append(DeviceStatsInfo(gpu=gpu.index, uuid=inst.uuid, kind="mig", profile=inst.profile,
                                           busy_fraction=min(1.0, busy.get(inst.uuid, 0.0))))
    return StatsResult(
        since=since, now=now, jain_index=fairness_index(users), devices=devices,
        users=[UserStatsInfo(user=u.user, weight=u.weight, jobs=u.jobs, starts=u.starts, runtime_s=u.runtime_s,
                             service_gpu_h=u.service_gpu_s / 3600, share=u.share, entitled=u.entitled,
                             wait_avg_s=u.wait_avg_s, wait_max_s=u.wait_max_s, wait_max_at=u.wait_max_at)
               for u in users],
    )


async def reload(ctx: Context, req: ReloadRequest) -> ReloadResult:
    _require_admin(ctx, "reload the configuration")
    if ctx.reload is None:
        raise ProtocolError(ErrorCode.INVALID_STATE, "this daemon cannot reload its configuration")
    try:
        return await ctx.reload()
    except ConfigError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"configuration not reloaded: {exc}",
                            "fix the file and reload again; the daemon keeps running on its previous configuration"
                            ) from None


async def doctor(ctx: Context, req: DoctorRequest) -> DoctorResult:
    checks = await asyncio.to_thread(run_checks, ctx.engine, ctx.socket_path)
    if not ctx.admin:  # other users' pids and command lines are theirs
        checks = [c.model_copy(update={"detail": "CUDA processes not started by gpusched are present"})
                  if c.name == "processes" and c.status != "PASS" else c for c in checks]
    return DoctorResult(checks=checks)


def gpus(ctx: Context, req: GpusRequest) -> GpusResult:
    inventory = ctx.engine.inventory
    holders: dict[str, list[Job]] = {}
    for job in ctx.engine.active_jobs():
        if job.allocation is not None:
            for uuid in job.allocation.uuids:
                holders.setdefault(uuid, []).append(job)
    out = []
    devices = ctx.engine.devices
    for gpu in inventory.gpus:
        health = _health(gpu.uuid, devices.drain_reason(gpu.uuid), inventory.errors.get(gpu.index))
        instances = [
            InstanceInfo(
                uuid=i.uuid, profile=i.profile, start=i.start, size=i.size, memory_mib=i.memory_mib,
                sm_count=i.sm_count, health=_health(i.uuid, devices.drain_reason(i.uuid), None) if health == "ok"
                else health, jobs=[j.id for j in holders.get(i.uuid, [])],
                users=sorted({j.user for j in holders.get(i.uuid, [])}), gi_id=i.gi_id,
            )
            for i in sorted(gpu.instances, key=lambda i: i.start)
        ]
        gpu_config = ctx.engine.config.gpus.get(str(gpu.index))
        on_gpu = holders.get(gpu.uuid, [])
        out.append(GpuInfo(
            index=gpu.index, uuid=gpu.uuid, name=gpu.name, model=gpu.model, memory_total_mib=gpu.memory_total_mib,
            memory_used_mib=gpu.memory_used_mib, sm_count=gpu.sm_count, mig_enabled=gpu.mig_enabled,
            mig_pending=gpu.mig_pending, health=health, instances=instances, jobs=[j.id for j in on_gpu],
            users=sorted({j.user for j in on_gpu}),
            share=gpu_config.share if gpu_config is not None else "exclusive",
            interactive=gpu_config.interactive if gpu_config is not None else False,
            vendor=gpu.vendor, partition=_partition(gpu),
        ))
    return GpusResult(backend=ctx.backend_name, driver_version=inventory.driver_version, gpus=out)


def _partition(gpu: Gpu) -> PartitionInfo | None:
    p = gpu.partition
    if p is None:
        return None
    return PartitionInfo(physical_index=p.physical_index, physical_uuid=p.physical_uuid,
                         compute_mode=p.compute_mode, memory_mode=p.memory_mode,
                         index_in_physical=p.index_in_physical, count=p.count)


def shutdown(ctx: Context, req: ShutdownRequest) -> ShutdownResult:
    if not ctx.admin:
        raise ProtocolError(ErrorCode.PERMISSION_DENIED, "only an administrator may shut the daemon down",
                            "use `sudo systemctl stop gpusched`")
    ctx.request_shutdown()
    return ShutdownResult(stopping=True)
