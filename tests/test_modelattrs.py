"""`BaseModel.__getattr__` is removed while no model needs it (gpusched/modelattrs.py): gpusched's
models read their attributes at CPython's fast path, and a model that does need the hook (private
attributes, extra fields) gets it back the moment it is defined."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import textwrap

import pytest
from pydantic import BaseModel

import gpusched
from gpusched import modelattrs
from gpusched.model import Job, JobSpec, WholeRequest

# Scripts run on their own (`python -I path`), never imported by the daemon.
NOT_IMPORTED = {"gpusched.daemon.forkserver", "gpusched.daemon.shim"}


def test_no_model_of_gpusched_needs_the_hook_so_it_is_removed() -> None:
    for module in pkgutil.walk_packages(gpusched.__path__, "gpusched."):
        if module.name not in NOT_IMPORTED and not module.name.startswith("gpusched.core._native"):
            importlib.import_module(module.name)
    ours = [cls for cls in modelattrs.all_models() if cls.__module__.startswith(("gpusched.", "gpusched_cli."))]
    assert len(ours) > 40, ours  # every request, result, spec and config section
    needing = [cls.__qualname__ for cls in ours if modelattrs.needs_hook(cls)]
    assert not needing, (f"{needing} read private attributes or extra fields through BaseModel.__getattr__, which "
                         "puts it back and slows every model's attribute reads: see gpusched/modelattrs.py")
    assert modelattrs.hook_removed()
    assert not any("__getattr__" in cls.__dict__ for cls in Job.__mro__)  # (the metaclass keeps its own)


def test_models_behave_the_same_without_the_hook() -> None:
    spec = JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1))
    assert spec.argv == ["true"] and spec.request.gpus == 1 and spec.model_copy(update={"nice": 3}).nice == 3
    with pytest.raises(AttributeError, match="'JobSpec' object has no attribute 'no_such_field'"):
        spec.no_such_field  # type: ignore[attr-defined]  # noqa: B018


def test_a_model_that_needs_the_hook_gets_it_back_when_it_is_defined() -> None:
    """In a process of its own: putting the hook back is for good (only slower reads for the others)."""
    program = textwrap.dedent("""
        from pydantic import BaseModel, ConfigDict, PrivateAttr
        from gpusched import modelattrs
        from gpusched.model import JobSpec, WholeRequest
        assert modelattrs.hook_removed()

        class Plain(BaseModel):
            x: int = 1

        assert modelattrs.hook_removed(), "a model without private attributes needs no hook"

        class Private(BaseModel):
            _secret: int = PrivateAttr(default=7)

        assert not modelattrs.hook_removed()
        assert Private()._secret == 7
        assert modelattrs.remove_hook() is False and not modelattrs.hook_removed()

        class Extra(BaseModel):
            model_config = ConfigDict(extra="allow")

        assert Extra(y=2).y == 2
        assert JobSpec(argv=["true"], cwd="/tmp", request=WholeRequest(gpus=1)).argv == ["true"]
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_hook_is_left_in_place_when_a_model_already_defined_needs_it() -> None:
    program = textwrap.dedent("""
        from pydantic import BaseModel, PrivateAttr

        class Early(BaseModel):
            _cache: dict = PrivateAttr(default_factory=dict)

        from gpusched import modelattrs
        import gpusched.model
        assert not modelattrs.hook_removed()
        assert Early()._cache == {}
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_pydantic_in_use_still_has_the_hook_this_module_removes() -> None:
    """If a pydantic release drops `__getattr__` (or renames the subclass hook), modelattrs does nothing;
    this says so, so that the note in modelattrs.py does not outlive what it describes."""
    assert modelattrs._HOOK is not None and isinstance(modelattrs._INIT_SUBCLASS, classmethod)
    assert "__getattr__" not in BaseModel.__dict__
