"""What a submitted spec must pass beyond a JobSpec's own validation (`SubmitRequest`): checks made
at submission only, so that stored jobs from before a check still load, and that spare a job the
wait for its turn when it could only fail at its launch."""

from __future__ import annotations

from gpusched.model import JobSpec, ShareRequest, spec_bytes, utf8_len
from gpusched.wire import MIN_SHARE

MAX_ARG_STRLEN = 131072  # linux/binfmts.h: the most bytes one argument or variable may take, its NUL included


def check_submittable(spec: JobSpec) -> None:
    """Raise ValueError naming the field and the problem."""
    # JSON carries lone surrogates ("\udcff") that no file, process or database takes as text:
    # refused here, not an internal error at the write.
    env = [f"{k}={v}" for k, v in spec.env.items()]
    for what, values in (("argv", spec.argv), ("env", env)):
        try:
            "\0".join(values).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{what} holds text that is not valid Unicode (a lone surrogate)") from None
    # What execve takes: a name without '=' (or NUL), a value without NUL, and no single string of
    # MAX_ARG_STRLEN bytes or more (the 256 KiB spec limit allows one).
    for key, value in spec.env.items():
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"env: variable name {_shown(key)} is not one a program can receive "
                             "(empty, or with '=' or a NUL byte)")
        if "\0" in value:
            raise ValueError(f"env: the value of {_shown(key)} contains a NUL byte")
    # No string takes more than the whole spec (spec_bytes counts each one's bytes and more), which its own
    # validator has measured: only a spec over the limit, a rare one, has its strings measured one by one.
    if spec_bytes(spec) > MAX_ARG_STRLEN:
        for what, strings in (("argv", spec.argv), ("env", env)):
            for text in strings:
                size = utf8_len(text) + 1
                if size > MAX_ARG_STRLEN:
                    raise ValueError(f"{what}: {_shown(text)} takes {size} bytes with its NUL; the kernel passes "
                                     f"a program no single argument or variable over {MAX_ARG_STRLEN} bytes")
    # MPS caps SMs in whole percent (launch.py): a smaller share got 1 %, charged its tiny fraction
    if isinstance(spec.request, ShareRequest) and spec.request.fraction < MIN_SHARE:
        raise ValueError(f"request.fraction {spec.request.fraction:g} is below {MIN_SHARE:g}: a share is at least "
                         f"1% of a GPU (MPS caps a client's SMs in whole percent)")


def _shown(text: str) -> str:
    """A user's string in a message, bounded (a name may be 256 KiB long)."""
    return repr(text if len(text) <= 40 else text[:40] + "...")
