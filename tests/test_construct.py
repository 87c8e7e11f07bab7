"""`construct` builds what validation would, and its shared fields-set survives copies."""

from __future__ import annotations

from gpusched.construct import construct, fields_of
from gpusched.model import AllocatedDevice, Allocation


def test_construct_builds_what_validation_builds() -> None:
    fields = fields_of(AllocatedDevice)
    device = construct(AllocatedDevice, fields, {"uuid": "MIG-1", "gpu_index": 2, "kind": "mig", "profile": "1g.10gb"})
    validated = AllocatedDevice(uuid="MIG-1", gpu_index=2, kind="mig", profile="1g.10gb")
    assert device == validated and device.model_dump_json() == validated.model_dump_json()
    alloc = construct(Allocation, fields_of(Allocation), {"devices": [device], "compute_fraction": 0.25, "share": None,
                                                          "gpu_mem_mib": None, "env": {"A": "1"}})
    assert alloc == Allocation.model_validate(alloc.model_dump())
    assert alloc.uuids == ["MIG-1"]


def test_a_copy_does_not_change_the_shared_fields_set() -> None:
    fields = fields_of(AllocatedDevice)
    before = set(fields)
    one = construct(AllocatedDevice, fields, {"uuid": "GPU-1", "gpu_index": 0, "kind": "gpu", "profile": None})
    copied = one.model_copy(update={"gpu_index": 3})
    assert fields == before
    assert (one.gpu_index, copied.gpu_index) == (0, 3)


def test_construct_fills_the_model_as_model_construct_does() -> None:
    """`construct` sets BaseModel's slots through their descriptors: the instance must be the one
    `model_construct` gives, down to the slots pickling and copying read."""
    import copy
    import pickle

    values = {"uuid": "GPU-2", "gpu_index": 1, "kind": "gpu", "profile": None}
    fields = fields_of(AllocatedDevice)
    built = construct(AllocatedDevice, fields, dict(values))
    reference = AllocatedDevice.model_construct(fields, **values)
    for name in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__"):
        assert getattr(built, name) == getattr(reference, name), name
    assert built.__pydantic_fields_set__ is fields  # shared, not copied
    assert pickle.loads(pickle.dumps(built)) == reference == copy.deepcopy(built)
    assert repr(built) == repr(reference)
