"""Results as the client handles them: plain JSON objects, checked against the models only on demand.

Building the pydantic models of the protocol costs the client ~100 ms at every start, more than the
whole of a fast command. So commands read the daemon's reply as the JSON object it is (its shape is
the documented `--json` shape), and the models are consulted only when that reading fails, to say
exactly what the daemon got wrong. Standard library only.
"""

from __future__ import annotations

from contextlib import contextmanager

from gpusched.wire import ErrorCode, ProtocolError

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
    from typing import Any

    JSON = Mapping[str, Any]

# Job states by name, as they travel (gpusched.model.JobState is a StrEnum of the same names; a test
# keeps these sets equal to the model's TERMINAL_STATES and WAITING_STATES).
COMPLETED, FAILED, CANCELLED, TIMEOUT, LOST = "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "LOST"
TERMINAL_STATES = frozenset({COMPLETED, FAILED, CANCELLED, TIMEOUT, LOST})
WAITING_STATES = frozenset({"PENDING", "HELD"})


def plain(obj: Any) -> JSON:
    """The JSON shape of a result: what the daemon sent, or a pydantic model of it dumped as the daemon does.

    Accepting both keeps the renderer usable from typed code (tests, `top`) without making the
    client import pydantic.
    """
    dump = getattr(obj, "model_dump", None)
    shape: JSON = dump(mode="json") if dump is not None else obj
    return shape


@contextmanager
def reading(op: str, result: JSON) -> Iterator[None]:
    """Read `result` (the reply to `op`) inside this block; if it has the wrong shape, say how.

    A missing key or a wrong type surfaces as KeyError/TypeError/...; only then is the result
    validated against its model, so a malformed reply reads `daemon sent a malformed result: ...` as
    it always did, and a bug of ours in a valid reply still shows as the bug it is.
    """
    try:
        yield
    except (KeyError, TypeError, AttributeError, ValueError, IndexError):
        from pydantic import ValidationError  # only now: explaining costs what reading need not

        from gpusched.protocol import RESULT_TYPES

        try:
            RESULT_TYPES[op].model_validate(result)
        except ValidationError as exc:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"daemon sent a malformed result: {exc}") from None
        raise
