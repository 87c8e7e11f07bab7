"""gres.conf / NodeName / index map from a real daemon's inventory (simulated GPUs)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from gpusched.protocol import GpusRequest, GpusResult
from gpusched.slurm import devfiles, gresconf
from tests.conftest import DaemonHandle


def inventory(daemon_factory: Callable[..., DaemonHandle], sim: str, gpus: dict[str, dict[str, object]]) -> GpusResult:
    handle = daemon_factory(sim=sim, gpus=gpus)
    with handle.client() as client:
        return client.call(GpusRequest(), GpusResult)


def test_whole_gpus_come_first_then_mig_types_and_the_map_numbers_them_alike(
    daemon_factory: Callable[..., DaemonHandle],
) -> None:
    result = inventory(daemon_factory, "A100-80GB:3", {"1": {"mig": ["3g.40gb", "2g.20gb", "2g.20gb"]},
                                                       "2": {"mig": ["2g.20gb", "1g.10gb"]}})
    devs = gresconf.devices(result, "/dev")
    assert [d.index for d in devs] == list(range(6))
    assert [d.type for d in devs] == ["a100-80gb", "1g.10gb", "2g.20gb", "2g.20gb", "2g.20gb", "3g.40gb"]
    assert [d.gpu_index for d in devs if d.type == "2g.20gb"] == [1, 1, 2]  # by GPU, then memory slice
    by_uuid = {i.uuid: (g.index, i) for g in result.gpus for i in g.instances}
    for d in devs[1:]:
        gpu, inst = by_uuid[d.uuid]
        assert (d.gpu_index, d.type, d.gi_id) == (gpu, inst.profile, inst.gi_id)
        gi_minor, ci_minor = gresconf.mig_cap_minors(gpu, inst.gi_id or 0)
        assert d.files == (f"/dev/nvidia{gpu}", f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
                           f"/dev/nvidia-caps/nvidia-cap{ci_minor}")
    assert devs[0].uuid == result.gpus[0].uuid and devs[0].files == ("/dev/nvidia0",)
    # Slurm numbers records grouped by type in Gres= order: both must follow the map's order.
    records = [ln for ln in gresconf.gres_conf("g1", devs).splitlines() if ln.startswith("NodeName=")]
    assert [r.split("Type=")[1].split()[0] for r in records] == [d.type for d in devs]
    assert all(("MultipleFiles=" in r) == (d.gi_id is not None) for r, d in zip(records, devs, strict=True))
    assert gresconf.gres_spec(devs) == "gpu:a100-80gb:1,gpu:1g.10gb:1,gpu:2g.20gb:3,gpu:3g.40gb:1"
    assert gresconf.node_line("g1", devs, "CPUs=64") == f"NodeName=g1 CPUs=64 Gres={gresconf.gres_spec(devs)}\n"
    assert gresconf.load_map(gresconf.gres_map("g1", devs)) == devs


def test_billing_weights_charge_a_slice_its_share_of_the_gpu(daemon_factory: Callable[..., DaemonHandle]) -> None:
    result = inventory(daemon_factory, "A100-80GB:2", {"1": {"mig": ["3g.40gb", "1g.10gb", "1g.10gb"]}})
    # gpusched's service: instance SMs / GPU SMs, so an A100 1g slice is 14/108, 3g is 42/108.
    assert gresconf.billing_weights(result) == (
        "GRES/gpu:1g.10gb=0.1296,GRES/gpu:3g.40gb=0.3889,GRES/gpu:a100-80gb=1.0000")


def test_mig_cap_minors_follow_the_drivers_mig_minors_table() -> None:
    assert gresconf.mig_cap_minors(0, 2) == (21, 22)  # gpu0/gi2/access 21, gpu0/gi2/ci0/access 22
    assert gresconf.mig_cap_minors(0, 0) == (3, 4)
    assert gresconf.mig_cap_minors(1, 0) == (138, 139)


def test_gres_mps_is_offered_only_where_slurm_can_pair_it(daemon_factory: Callable[..., DaemonHandle]) -> None:
    whole = inventory(daemon_factory, "H100-80GB:2", {"0": {"share": "mps"}, "1": {"share": "mps"}})
    devs = gresconf.devices(whole, "/dev", gres_mps=True)
    assert [d.gres_mps for d in devs] == [True, True] and gresconf.mps_skipped(whole, devs) == []
    assert gresconf.gres_spec(devs) == "gpu:h100-80gb:2,mps:h100-80gb:200"
    assert not any(d.gres_mps for d in gresconf.devices(whole, "/dev"))  # only on request
    sharded = gresconf.devices(whole, "/dev", gres_shards=4)
    assert gresconf.gres_spec(sharded) == "gpu:h100-80gb:2,shard:h100-80gb:8"
    assert "NodeName=g1 Name=shard Type=h100-80gb Count=4 File=/dev/nvidia1" in gresconf.gres_conf("g1", sharded)
    mixed = inventory(daemon_factory, "H100-80GB:2", {"0": {"share": "mps"}, "1": {"mig": ["3g.40gb"]}})
    devs = gresconf.devices(mixed, "/dev", gres_mps=True)
    assert not any(d.gres_mps for d in devs) and devs[0].mps  # the hooks still start MPS for its jobs
    assert gresconf.mps_skipped(mixed, devs) == ["GPU 0: Slurm cannot mix gres/mps with MIG GPUs on one node"]


def test_a_node_block_is_replaced_in_place_and_others_are_kept() -> None:
    text = "GresTypes=gpu\n"
    text = gresconf.replace_block(text, "n1", "NodeName=n1 Gres=gpu:a:1\n")
    text = gresconf.replace_block(text, "n2", "NodeName=n2 Gres=gpu:b:1\n")
    text = gresconf.replace_block(text, "n1", "NodeName=n1 Gres=gpu:c:2\n")
    assert text.startswith("GresTypes=gpu\n")
    assert gresconf.block_body(text, "n1") == "NodeName=n1 Gres=gpu:c:2"
    assert gresconf.block_body(text, "n2") == "NodeName=n2 Gres=gpu:b:1"
    assert text.count("# BEGIN gpusched node n1") == 1
    assert gresconf.node_params("NodeName=n1 NodeAddr=10.0.0.1 CPUs=8 Gres=gpu:a:1") == "NodeAddr=10.0.0.1 CPUs=8"
    with pytest.raises(ValueError, match="without"):
        gresconf.replace_block("# BEGIN gpusched node n3\nx\n", "n3", "y")


def test_a_damaged_map_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="not a gpusched GRES map"):
        gresconf.load_map('{"gpus": [{"index": 0}]}')
    with pytest.raises(ValueError, match="not a gpusched GRES map"):
        gresconf.load_map("[")


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_device_files_are_character_devices_with_the_drivers_numbers(
    daemon_factory: Callable[..., DaemonHandle], tmp_path: Path,
) -> None:
    result = inventory(daemon_factory, "A100-40GB:1", {"0": {"mig": ["3g.20gb"]}})
    root = str(tmp_path / "dev")
    devs = gresconf.devices(result, root)
    created = devfiles.make_device_files(devs, root)
    assert sorted(created) == sorted(devs[0].files)
    for path in created:
        st = os.stat(path)
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == devfiles.device_number(path)
    assert devfiles.make_device_files(devs, root) == []  # kept as they are
    os.unlink(created[0])
    Path(created[0]).write_text("not a device")
    with pytest.raises(ValueError, match="not character device"):
        devfiles.make_device_files(devs, root)


def test_a_node_whose_name_begins_another_keeps_its_own_block() -> None:
    """n1's marker is a prefix of n10's: exporting n1 replaced n10's block in the shared file."""
    text = gresconf.replace_block("", "n10", "NodeName=n10 Gres=gpu:a100-80gb:8")
    text = gresconf.replace_block(text, "n1", "NodeName=n1 Gres=gpu:h100-80gb:2")
    text = gresconf.replace_block(text, "n1", "NodeName=n1 Gres=gpu:h100-80gb:4")
    assert gresconf.block_body(text, "n10") == "NodeName=n10 Gres=gpu:a100-80gb:8", text
    assert gresconf.block_body(text, "n1") == "NodeName=n1 Gres=gpu:h100-80gb:4", text


def test_export_warns_of_what_it_cannot_offer_and_refuses_a_bad_node_name(
    daemon_factory: Callable[..., DaemonHandle],
) -> None:
    """Printing (no --out) dropped the gres/mps warning; any --node or --node-params was taken, a
    newline included, which split the lines of gres.conf and of the root-run Prolog script."""
    from tests.cli.test_commands import gs

    handle = daemon_factory(sim="H100-80GB:2", gpus={"0": {"share": "mps"}, "1": {"mig": ["3g.40gb"]}})
    printed = gs(handle, "slurm", "export", "--node", "n1", "--gres-mps")
    assert printed.exit_code == 0, printed.output
    assert "warning: not offered as gres/mps or gres/shard: GPU 0: Slurm cannot mix" in printed.stderr
    for args in (["--node", "a b"], ["--node", "n1\nrm -rf /"], ["--node", "n1", "--node-params", "CPUs=8\nX=1"]):
        refused = gs(handle, "slurm", "export", *args)
        assert refused.exit_code == 2, (args, refused.output)


def test_an_amd_node_is_refused_rather_than_given_cuda_ids(daemon_factory: Callable[..., DaemonHandle]) -> None:
    """The hooks would export CUDA_VISIBLE_DEVICES with amdsmi ids and NVIDIA device files."""
    result = inventory(daemon_factory, "MI300X:2", {})
    with pytest.raises(ValueError, match=r"GPU\(s\) 0, 1 are AMD Instinct logical GPUs.*does not support AMD"):
        gresconf.devices(result)
