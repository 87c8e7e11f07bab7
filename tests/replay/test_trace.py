"""Trace parsers: every bad value reported by line and field; the Alibaba mapping on rows in its format."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpusched.model import MigRequest, ShareRequest, WholeRequest
from gpusched.replay.trace import TraceError, detect_format, load_trace, parse_alibaba, parse_csv, user_of
from tests.replay.conftest import ALIBABA


def test_csv_parses_each_request_kind(write_csv: Callable[[str], str]) -> None:
    path = write_csv("""
submit_time,duration,user,gpus,mig,share,gpu_mem,class,weight,time_limit,requeue,precision
5,100,alice,2,,,,,200,,,
0,50,bob,,3g.40gb,,,interactive,,60,1,fp16
1,10,carol,,,0.25,2048.5,,,,,
""")
    trace = parse_csv(path)
    assert [j.user for j in trace.jobs] == ["bob", "carol", "alice"]  # by submit time
    bob, carol, alice = trace.jobs
    assert alice.request == WholeRequest(gpus=2) and alice.weight == 200 and alice.line == 2
    assert bob.request == MigRequest(profile="3g.40gb") and bob.job_class == "interactive"
    assert bob.time_limit_s == 60 and bob.requeue and bob.precision == "fp16"
    assert carol.request == ShareRequest(fraction=0.25, gpu_mem_mib=2049)
    assert trace.weights() == {"alice": 200}


def test_csv_errors_name_line_and_field(write_csv: Callable[[str], str]) -> None:
    path = write_csv("""
submit_time,duration,user,gpus,mig,share,gpu_mem,weight,requeue
0,10,a,1,,,,,
x,10,a,1,,,,,
0,-5,a,1,,,,,
0,10,,1,3g.40gb,,,,
0,10,a,,,1.5,100,,
0,10,a,,,0.5,,,
0,10,a,,bogus,,,,
0,10,a,1,,,,0,2
0,10,b,1,,,,100,
0,10,b,1,,,,300,
""")
    with pytest.raises(TraceError) as info:
        parse_csv(path)
    found = {(e.line, e.field) for e in info.value.errors}
    assert found == {
        (3, "submit_time"), (4, "duration"), (5, "user"), (5, "gpus|mig|share"), (6, "share"),
        (7, "gpu_mem"), (8, "mig"), (9, "weight"), (9, "requeue"), (11, "weight"),
    }
    text = str(info.value)
    assert "line 3, field 'submit_time': 'x' is not a number" in text
    assert "line 11, field 'weight': user 'b' already has weight 100 (line 10)" in text


def test_csv_header_problems(write_csv: Callable[[str], str]) -> None:
    with pytest.raises(TraceError) as info:
        parse_csv(write_csv("submit_time,user,colour\n0,a,red\n"))
    assert {(e.line, e.field) for e in info.value.errors} == {
        (1, "duration"), (1, "gpus|mig|share"), (1, "colour")}


def test_format_detection(write_csv: Callable[[str], str]) -> None:
    assert detect_format(write_csv("submit_time,duration,user,gpus\n0,1,a,1\n")) == "csv"
    assert detect_format(str(ALIBABA)) == "alibaba"


def test_alibaba_sample_rows() -> None:
    trace = parse_alibaba(str(ALIBABA), gpus=8, gpu_memory_mib=81559, load=0.9, users=4, seed=1, limit=300)
    # Counted independently from the fixture: 15 x 1 GPU, 1 x 2 GPUs, 2 x 8 GPUs, 10 fractions kept;
    # 3 pods never scheduled and 4 without a GPU skipped.
    assert len(trace.jobs) == 28
    assert dict(trace.skipped) == {"never scheduled": 3, "no GPU": 4}
    kinds = [type(j.request).__name__ for j in trace.jobs]
    assert kinds.count("WholeRequest") == 18 and kinds.count("ShareRequest") == 10
    assert sum(1 for j in trace.jobs if isinstance(j.request, WholeRequest) and j.request.gpus == 8) == 2
    pod1 = next(j for j in trace.jobs if j.name == "openb-pod-0001")  # 1 GPU, gpu_milli 460
    assert pod1.request == ShareRequest(fraction=0.46, gpu_mem_mib=37518)  # ceil(0.46 x 81559)
    assert pod1.duration_s == 12902960 - 427061 and pod1.flexible
    assert len(trace.users()) == 4 and all(j.user == user_of(j.name, 4, 1) for j in trace.jobs)
    assert len(parse_alibaba(str(ALIBABA), gpus=8, gpu_memory_mib=81559, limit=10).jobs) < len(trace.jobs)


def test_alibaba_load_scales_arrivals() -> None:
    a = parse_alibaba(str(ALIBABA), gpus=8, gpu_memory_mib=81559, load=0.9)
    b = parse_alibaba(str(ALIBABA), gpus=8, gpu_memory_mib=81559, load=0.45)
    assert b.time_scale == pytest.approx(2 * a.time_scale)
    demand = sum(j.gpu_demand * j.duration_s for j in a.jobs)
    span = a.jobs[-1].submit_s - a.jobs[0].submit_s
    assert demand / (8 * span) == pytest.approx(0.9)


def test_user_assignment_depends_on_seed() -> None:
    names = [f"openb-pod-{i:04d}" for i in range(200)]
    assert [user_of(n, 16, 1) for n in names] == [user_of(n, 16, 1) for n in names]
    assert [user_of(n, 16, 1) for n in names] != [user_of(n, 16, 2) for n in names]


# Four GPU pods; the trace was taken at 5000, the last deletion_time in the file (the pod without a
# GPU ends there too): pods 1 and 3 were still running then, so their durations are lower bounds.
CENSORED = """
name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p0,1000,1024,1,1000,,BE,Succeeded,0,100,0
p1,1000,1024,1,460,,LS,Running,10,5000,10
p2,1000,1024,2,1000,,BE,Failed,20,420,20
p3,1000,1024,1,1000,,LS,Running,30,5000,40
p4,1000,1024,0,0,,LS,Running,40,5000,40
"""


def test_censored_pods_are_kept_by_default_and_dropped_before_load_scaling(write_csv: Callable[[str], str]) -> None:
    path = write_csv(CENSORED)
    kept = parse_alibaba(path, gpus=2, gpu_memory_mib=81559, load=0.5)
    assert [j.name for j in kept.jobs] == ["p0", "p1", "p2", "p3"]
    assert "still running when the trace was taken (--censored drop)" not in kept.skipped
    dropped = parse_alibaba(path, gpus=2, gpu_memory_mib=81559, load=0.5, censored="drop")
    assert [j.name for j in dropped.jobs] == ["p0", "p2"]
    assert dropped.skipped["still running when the trace was taken (--censored drop)"] == 2
    assert dropped.skipped["no GPU"] == 1
    # The load is reached by the jobs that remain: 100 + 2 x 400 GPU-s over the scaled span 0..20.
    span = dropped.jobs[-1].submit_s - dropped.jobs[0].submit_s
    assert (100 + 2 * 400) / (2 * span) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="--censored must be keep or drop"):
        parse_alibaba(path, gpus=2, gpu_memory_mib=81559, censored="trim")  # type: ignore[arg-type]


def test_censored_is_only_for_alibaba_pod_lists(write_csv: Callable[[str], str]) -> None:
    path = write_csv("submit_time,duration,user,gpus\n0,10,a,1\n")
    with pytest.raises(ValueError, match="--censored is for Alibaba pod lists"):
        load_trace(path, censored="drop")
