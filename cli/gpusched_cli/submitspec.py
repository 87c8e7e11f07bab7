"""What `gpusched submit` checks of the spec it built before sending it: the JobSpec limits its
flags leave open (the model is consulted only for a spec that might break one, so the common case
imports no pydantic), and the environment it passes on."""

from __future__ import annotations

import os

from gpusched.wire import MAX_MEM_MIB
from gpusched_cli.options import UsageProblem

TYPE_CHECKING = False  # typing costs the fast path a few ms to import; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any

# JobSpec's limits that the flags above leave open (gpusched.model; tests/cli/test_messages.py keeps
# them equal). A spec inside them is valid; one that may be outside goes to the model for its verdict.
MAX_SPEC_BYTES = 256 * 1024
SPEC_STRING_OVERHEAD = 9
MAX_NAME = 128
MAX_PROFILE = 32
MAX_AFTER = 64


def submitting_environ() -> dict[str, str]:
    """The environment `submit` passes on. In the C locale Python sets LC_CTYPE=C.UTF-8 in its own
    environment at start (PEP 538), over what was there: a job from cron or a bare ssh must not get
    a locale its submitter never had, so that one variable goes back to what the process was started
    with (`LC_CTYPE=0`, an unknown locale, stays `0`), or is left out if it had none."""
    env = dict(os.environ)
    if env.get("LC_CTYPE") == "C.UTF-8":
        try:
            with open("/proc/self/environ", "rb") as f:
                started_with = f.read().split(b"\0")
        except OSError:
            return env
        # The first one, as os.environ takes a variable given twice.
        given = next((value for name, _, value in (item.partition(b"=") for item in started_with)
                      if name == b"LC_CTYPE"), None)
        if given is None:
            del env["LC_CTYPE"]
        else:
            env["LC_CTYPE"] = os.fsdecode(given)
    return env


def might_be_invalid(spec: dict[str, Any]) -> bool:
    """True unless `spec` is certainly within JobSpec's limits (flag values are checked already).

    The size test is an upper bound of model.spec_bytes, not a copy of it: UTF-8 takes at most 4
    bytes a character, so only a spec near the limit (far above a usual environment) pays for the model.
    """
    strings = [*spec["argv"], spec["cwd"], *(f"{k}={v}" for k, v in spec["env"].items())]
    if spec["name"] is not None:
        if len(spec["name"]) > MAX_NAME:
            return True
        strings.append(spec["name"])
    request = spec["request"]
    return (
        sum(4 * len(s) + SPEC_STRING_OVERHEAD for s in strings) > MAX_SPEC_BYTES
        or any("\x00" in arg for arg in spec["argv"])
        or (request["kind"] == "mig" and len(request["profile"]) > MAX_PROFILE)
        or len(spec["after"]) > MAX_AFTER
        or (spec["mem_mib"] or 0) > MAX_MEM_MIB
    )


# The flag each field of a job spec comes from, to name it when the model refuses a value.
_FLAG_OF_FIELD = {
    "name": "--name", "time_limit_s": "--time", "job_class": "--class", "nice": "--nice", "cpus": "--cpus",
    "mem_mib": "--mem", "precision": "--precision", "after": "--after", "env": "--export", "argv": "CMD",
    "request.gpus": "--gpus", "request.profile": "--mig", "request.fraction": "--share",
    "request.gpu_mem_mib": "--gpu-mem", "request.mode": "--partition",
}


def check_with_model(spec: dict[str, Any]) -> None:
    """Validate `spec` with the JobSpec model; a refusal is a UsageProblem naming the flag (or, for
    the rest of a spec, the field)."""
    from pydantic import ValidationError

    from gpusched.model import JobSpec
    from gpusched.protocol import describe_validation_error
    from gpusched.submittable import check_submittable

    try:
        check_submittable(JobSpec.model_validate(spec))
    except ValidationError as exc:
        path = describe_validation_error(exc).split(":", 1)[0]
        flag = next((f for field, f in _FLAG_OF_FIELD.items() if path == field or path.startswith(field + ".")),
                    None)
        message = str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
        if not exc.errors()[0]["loc"]:  # the spec as a whole (its size): what to shrink is in the message
            raise UsageProblem(f"the job's CMD, --export environment, directory and --name: {message}") from None
        if flag is None:
            raise UsageProblem(describe_validation_error(exc)) from None
        raise UsageProblem(message, f"'{flag}'") from None
    except ValueError as exc:  # check_submittable: "argv: ..." or "env: ..."
        where, _, why = str(exc).partition(": ")
        hint = {"argv": "CMD", "env": "--export"}.get(where)
        if hint is None:
            raise UsageProblem(str(exc)) from None
        raise UsageProblem(why, f"'{hint}'") from None
