"""Attribute reads on pydantic models at CPython's fast path.

pydantic's `BaseModel` defines `__getattr__`, which Python consults only when an ordinary lookup
fails, to serve private attributes and extra fields. Its mere presence costs every read of every
model's attributes: CPython 3.11 specialises `obj.attr` only for classes without `__getattr__`, so
each `job.spec`, `spec.env` or `request.gpus` went the generic way (about 385 instructions each,
76 of them per submit: 5% of the daemon's instructions per submit, bench/instructions_daemon.py).

None of gpusched's models has a private attribute or allows extra fields (tests/test_modelattrs.py
checks every one), so for them the hook can only ever raise the AttributeError that the ordinary
lookup raises too, with the same message. It is therefore removed from `BaseModel`, unless a model
already defined needs it, and put back the moment a model class that needs it is defined (pydantic
calls `__pydantic_init_subclass__` on every new model class): nothing in the process can miss it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_HOOK = BaseModel.__dict__.get("__getattr__")
_INIT_SUBCLASS = BaseModel.__dict__.get("__pydantic_init_subclass__")


def needs_hook(cls: type[BaseModel]) -> bool:
    """Does the model read anything through `BaseModel.__getattr__` (private attributes, extra fields)?"""
    return bool(getattr(cls, "__private_attributes__", None)) or cls.model_config.get("extra") == "allow"


def all_models() -> list[type[BaseModel]]:
    """Every model class defined so far."""
    found: list[type[BaseModel]] = []
    todo = list(BaseModel.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def hook_removed() -> bool:
    return _HOOK is not None and "__getattr__" not in BaseModel.__dict__


def remove_hook() -> bool:
    """Remove `BaseModel.__getattr__` unless some model defined so far needs it, and watch the models
    defined from now on; True if it is removed now. Idempotent."""
    if _HOOK is None or not isinstance(_INIT_SUBCLASS, classmethod):  # not the pydantic this was written for
        return False
    if hook_removed():
        return True
    if any(needs_hook(cls) for cls in all_models()):
        return False
    # (by name: the typing of BaseModel has neither change; CPython re-derives every model class's slot)
    delattr(BaseModel, "__getattr__")
    setattr(BaseModel, "__pydantic_init_subclass__", classmethod(_init_subclass))  # noqa: B010
    return True


def _init_subclass(cls: type[BaseModel], /, **kwargs: Any) -> None:
    if needs_hook(cls) and hook_removed():
        setattr(BaseModel, "__getattr__", _HOOK)  # noqa: B010  # back for good: this model reads through it
    assert isinstance(_INIT_SUBCLASS, classmethod)
    _INIT_SUBCLASS.__func__(cls, **kwargs)
