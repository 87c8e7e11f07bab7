"""The requests the CLI sends, as plain JSON objects: each is what its pydantic model would dump.

Every field of the model is written, in the model's order and with its JSON type (`30.0`, not
`30`), so the frame is byte for byte the one `Request(...).model_dump(mode="json")` gave before the
client stopped importing pydantic. Members added in protocol 1.1 (arrays, request_id) are left out
while unset, as the models leave them out (`exclude_if`), so a 1.0 daemon still reads every frame
that does not use them. `tests/cli/test_messages.py` holds each builder to its model.
The daemon still validates every request with the models (gpusched/protocol.py); range checks not
made here are made there and come back as `bad_request` naming the field.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any

    Message = dict[str, Any]


def hello(version: str, client: str) -> Message:
    return {"op": "hello", "version": version, "client": client}


def submit(spec: Message, hold: bool, array: str | None = None, request_id: str | None = None) -> Message:
    message: Message = {"op": "submit", "spec": spec, "hold": hold}
    if array is not None:
        message["array"] = array
    if request_id is not None:
        message["request_id"] = request_id
    return message


def job_spec(
    *,
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    request: Message,
    name: str | None,
    time_limit_s: int | None,
    job_class: str,
    nice: int,
    requeue: bool,
    precision: str | None,
    after: list[Message],
    cpus: int | None,
    mem_mib: int | None,
) -> Message:
    """JobSpec's fields; `time_limit_s` is a float on the wire, as the model has it."""
    return {
        "argv": argv,
        "cwd": cwd,
        "env": env,
        "request": request,
        "name": name,
        "time_limit_s": None if time_limit_s is None else float(time_limit_s),
        "job_class": job_class,
        "nice": nice,
        "requeue": requeue,
        "precision": precision,
        "after": after,
        "cpus": cpus,
        "mem_mib": mem_mib,
    }


def whole(gpus: int) -> Message:
    return {"kind": "whole", "gpus": gpus}


def mig(profile: str) -> Message:
    return {"kind": "mig", "profile": profile}


def partition(mode: str, gpus: int) -> Message:
    return {"kind": "partition", "mode": mode, "gpus": gpus}


def share(fraction: float, gpu_mem_mib: int) -> Message:
    return {"kind": "share", "fraction": float(fraction), "gpu_mem_mib": gpu_mem_mib}


def dependency(job_id: int, condition: str) -> Message:
    return {"job_id": job_id, "condition": condition}


def queue(*, all_jobs: bool, user: str | None, limit: int, order: str, after_id: int | None = None,
          array_tasks: bool = False) -> Message:
    message: Message = {"op": "queue", "all": all_jobs, "user": user}
    if array_tasks:
        message["array_tasks"] = True
    return message | {"limit": limit, "after_id": after_id, "order": order}


def show(job_id: int, task: int | None = None) -> Message:
    """`task`: job_id names an array and this is the index of one of its tasks (`show 123_7`)."""
    return {"op": "show", "job_id": job_id} | ({"task": task} if task is not None else {})


def task_ref(array_id: int, task: int) -> Message:
    return {"array_id": array_id, "task": task}


def cancel(job_ids: list[int], tasks: list[Message] | None = None) -> Message:
    """`job_ids` are jobs or whole arrays; `tasks` single array tasks (`task_ref`)."""
    return {"op": "cancel", "job_ids": job_ids} | ({"tasks": tasks} if tasks else {})


def job_control(op: str, job_ids: list[int], tasks: list[Message] | None = None) -> Message:
    """suspend / resume / hold / release: the same shape under four names; `tasks` as for cancel."""
    return {"op": op, "job_ids": job_ids} | ({"tasks": tasks} if tasks else {})


LOGS_MAX_BYTES = 256 * 1024  # LogsRequest's default


def logs(job_id: int, offset: int, wait_s: float, task: int | None = None) -> Message:
    message: Message = {"op": "logs", "job_id": job_id}
    if task is not None:
        message["task"] = task
    return message | {"offset": offset, "max_bytes": LOGS_MAX_BYTES, "wait_s": float(wait_s)}


def wait(job_id: int, timeout_s: float, task: int | None = None) -> Message:
    """`task`: job_id names an array and this is the index of one of its tasks (`wait 123_7`)."""
    return {"op": "wait", "job_id": job_id} | ({"task": task} if task is not None else {}) | {
        "timeout_s": float(timeout_s)}


def gpu_drain(device: str, reason: str) -> Message:
    return {"op": "gpu_drain", "device": device, "reason": reason}


def gpu_resume(device: str) -> Message:
    return {"op": "gpu_resume", "device": device}


def mig_apply(gpu: int, layout: list[str], dry_run: bool) -> Message:
    return {"op": "mig_apply", "gpu": gpu, "layout": layout, "dry_run": dry_run}


def sim_inject_xid(gpu: int, xid: int, gi: int | None, ci: int | None, lost: bool) -> Message:
    return {"op": "sim_inject_xid", "gpu": gpu, "xid": xid, "gi": gi, "ci": ci, "lost": lost}


def stats(since_s: float) -> Message:
    return {"op": "stats", "since_s": float(since_s)}


def bare(op: str) -> Message:
    """gpus / doctor / reload / shutdown: requests with nothing but their name."""
    return {"op": op}
