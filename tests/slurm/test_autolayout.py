"""relayout --auto: demand from `squeue --json`, busy devices from GresUsed, the plan from core/migplan."""

from __future__ import annotations

from collections.abc import Callable

from gpusched.protocol import GpusRequest, GpusResult
from gpusched.slurm import autolayout, gresconf
from tests.conftest import DaemonHandle

# The fields gpusched reads, as `squeue --json` of Slurm 22.05.8 prints them.
SQUEUE = {"jobs": [
    {"job_id": 1, "job_state": "RUNNING", "state_reason": "None", "tres_per_node": "gres:gpu:4g.40gb:1"},
    {"job_id": 2, "job_state": "PENDING", "state_reason": "Resources", "tres_per_node": "gres:gpu:4g.40gb:1"},
    {"job_id": 3, "job_state": "PENDING", "state_reason": "Priority", "tres_per_node": "gres:gpu:1g.10gb:2"},
    {"job_id": 4, "job_state": "PENDING", "state_reason": "Dependency", "tres_per_node": "gres:gpu:2g.20gb:1"},
    {"job_id": 5, "job_state": "PENDING", "state_reason": "Resources", "tres_per_node": "gres:gpu:h100-80gb:1"},
    {"job_id": 6, "job_state": "PENDING", "state_reason": "Resources", "tres_per_node": "gres:gpu:1g.5gb:1"},
]}


def test_demand_is_what_pending_jobs_wait_for_that_the_node_could_offer() -> None:
    profiles = {"1g.10gb", "2g.20gb", "4g.40gb", "7g.80gb"}
    assert autolayout.pending_demand(SQUEUE, profiles) == ["4g.40gb", "1g.10gb", "1g.10gb"]


def test_busy_devices_come_from_gres_used_indices() -> None:
    devs = [gresconf.GresDevice(index=i, type="t", uuid=f"U{i}", gpu_index=0, gpu_uuid="G", gi_id=i, files=(),
                                mps=False) for i in range(5)]
    used = "gpu:1g.10gb:2(IDX:0,2-3),gpu:4g.40gb:0(IDX:N/A)"
    assert autolayout.busy_uuids(used, devs) == {"U0", "U2", "U3"}


def test_the_plan_keeps_busy_and_wanted_instances_and_counts_idle_ones_against_demand(
    daemon_factory: Callable[..., DaemonHandle],
) -> None:
    handle = daemon_factory(sim="A100-80GB:1", gpus={"0": {"mig": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]}})
    with handle.client() as client:
        result = client.call(GpusRequest(), GpusResult)
    by_profile = {i.profile: i.uuid for i in result.gpus[0].instances}
    # One idle 1g.10gb answers one pending 1g.10gb job: nothing to do.
    assert autolayout.plan(result, ["1g.10gb"], set()) == ({}, [])
    # The busy 3g.40gb stays; the 4g.40gb takes the idle instances' room.
    layouts, unmet = autolayout.plan(result, ["4g.40gb"], {by_profile["3g.40gb"]})
    assert unmet == [] and sorted(layouts[0]) == ["3g.40gb", "4g.40gb"]
    # With everything busy there is no room, and nothing changes.
    every = {i.uuid for i in result.gpus[0].instances}
    assert autolayout.plan(result, ["4g.40gb"], every) == ({}, ["4g.40gb"])
    # Instances of a profile still asked for are kept: with three 1g.10gb jobs waiting, the two idle
    # 1g.10gb stay and a third is made from idle instances of other profiles; a 4g.40gb (slices 0-3
    # is its only placement) would need room that kept instances hold, so it is reported, not forced.
    layouts, unmet = autolayout.plan(result, ["1g.10gb", "1g.10gb", "1g.10gb", "4g.40gb"], set())
    assert layouts[0].count("1g.10gb") == 3 and unmet == ["4g.40gb"]
