"""Jobs in memory at 100k: the parts queued jobs repeat are held once.

A sweep of 100,000 jobs is one command with one environment, one working directory and one
resource request, each repeated 100,000 times. Held naively (a validated pydantic tree per job)
that is ~5 KiB per queued job; sharing the repeated parts and skipping re-validation of what the
daemon itself wrote brings it to about a third, and makes a restart parse 100k specs in a second.

Sharing is safe because specs are frozen and nothing mutates their lists or dicts (the launcher
copies `env` before adding to it). The tables are bounded LRUs: interning is only an economy, so a
user who submits 100k distinct environments costs what they cost, never more than that plus a
fixed-size table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, TypeVar

from pydantic_core import from_json

from gpusched.construct import construct, fields_of
from gpusched.daemon.envstore import digest, env_json, surely_inline
from gpusched.daemon.schema import FIRST_REASON
from gpusched.model import (
    Allocation,
    AnyRequest,
    Dependency,
    Job,
    JobSpec,
    JobState,
    MigRequest,
    PartitionRequest,
    ShareRequest,
    Transition,
    WholeRequest,
    describe_request,
    display_name,
    spec_bytes,
)

DEFAULT_CAPACITY = 4096

_SPEC_FIELDS = frozenset(JobSpec.model_fields)
_SPEC_ORDER = tuple(JobSpec.model_fields)
# A stored spec is pydantic's JSON of it, fields in declaration order, argv first. Inside a JSON string
# a `"` is always escaped, so the first `],"cwd":` of the text is where argv ends, whatever argv
# holds; a text shaped otherwise (another version's) is parsed whole (Compactor._from_parts).
_ARGV_HEAD = '{"argv":['
_ARGV_END = '],"cwd":'
# What follows argv is kept parsed (a _Pool) only up to this many characters: a sweep's jobs differ
# in argv alone, and their shared rest is short (an environment of more than envstore.INLINE_MAX
# bytes is stored apart); a longer rest is parsed with its job, so the pool holds at most
# capacity x this many characters.
_REST_MAX = 1024
_REQUEST_TYPES: dict[str, type[WholeRequest] | type[MigRequest] | type[ShareRequest] | type[PartitionRequest]] = {
    "whole": WholeRequest, "mig": MigRequest, "share": ShareRequest, "partition": PartitionRequest,
}
# One fields-set object per model: pydantic copies it before any change (model_copy), so instances
# built with `model_construct` may share it instead of holding a 700-byte set each.
_SPEC_SET = fields_of(JobSpec)
_JOB_SET = fields_of(Job)
_TRANSITION_SET = fields_of(Transition)
_DEPENDENCY_SET = fields_of(Dependency)
_EMPTY_AFTER: list[Dependency] = []

K = TypeVar("K")
V = TypeVar("V")


class _Table(OrderedDict[K, V]):
    """A bounded LRU of shared values."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def share(self, key: K, value: V) -> V:
        found = self.get(key)
        if found is not None:
            self.move_to_end(key)
            return found
        self[key] = value
        if len(self) > self.capacity:
            self.popitem(last=False)
        return value


class _Pool(dict[K, V]):
    """A bounded pool of shared values that starts over when full: cheaper than an LRU on a hit (a
    restart asks it 800k times), and losing the pool only costs sharing, never correctness."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def share(self, key: K, value: V) -> V:
        found = self.get(key)
        if found is not None:
            return found
        if len(self) >= self.capacity:
            self.clear()
        self[key] = value
        return value


class Compactor:
    """Builds the in-memory form of jobs, sharing repeated parts; one per daemon."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._envs: _Pool[tuple[tuple[str, str], ...], dict[str, str]] = _Pool(capacity)
        self._argvs: _Pool[tuple[str, ...], list[str]] = _Pool(capacity)
        self._requests: _Pool[tuple[Any, ...], AnyRequest] = _Pool(capacity)
        self._strings: _Pool[str, str] = _Pool(capacity)
        # Keyed by the stored JSON text (with the digest of the environment stored apart from it, if it
        # is: envstore.py), so at most `capacity` texts of at most MAX_SPEC_BYTES each.
        self._specs: _Table[str | tuple[str, bytes], JobSpec] = _Table(capacity)
        # By object identity; the entry holds the spec, so its id cannot be reused while it is here.
        self._sizes: _Pool[int, tuple[JobSpec, int]] = _Pool(capacity)
        self._columns: _Pool[int, tuple[JobSpec, tuple[str, str, int]]] = _Pool(capacity)
        self._stored_envs: _Pool[int, tuple[dict[str, str], tuple[bytes, bytes] | None]] = _Pool(capacity)
        # A stored spec's text after its argv (with its environment's digest, if that is apart) -> every
        # field but argv, parsed and shared; None: that text is not of today's shape.
        self._rests: _Pool[str | tuple[str, bytes], dict[str, Any] | None] = _Pool(capacity)
        # The rest last parsed or found (its environment's digest, its text, its fields): a sweep's rows
        # come one after another with the same rest, and comparing the end of a row's text with it
        # costs less than cutting that text out and hashing it for the pool.
        self._last_rest: tuple[bytes | None, str, dict[str, Any] | None] | None = None
        # A stored argv's JSON text -> the list it parses to: a spec's argv is shared by its text, as
        # the row holds it, without parsing it first (`_argvs` is keyed by the parsed tuple).
        self._argv_texts: _Pool[str, list[str]] = _Pool(capacity)

    def stored_env(self, env: dict[str, str]) -> tuple[bytes, bytes] | None:
        """How `env` is stored apart (envstore.py): (its JSON, its digest), or None inline; worked
        out once per shared environment, as a sweep's submits all carry the same one."""
        if surely_inline(env):
            return None
        shared = self._envs.share(tuple(env.items()), env)
        found = self._stored_envs.get(id(shared))
        if found is not None and found[0] is shared:
            return found[1]
        text = env_json(shared)
        apart = None if text is None else (text, digest(text))
        self._stored_envs.share(id(shared), (shared, apart))
        return apart

    def spec_bytes(self, spec: JobSpec, measured: int | None = None) -> int:
        """`model.spec_bytes`, once per shared spec (per-user byte limits count every queued job).
        `measured`: what it is, when the caller knows (measured on an equal spec, the one submitted)."""
        found = self._sizes.get(id(spec))
        if found is not None and found[0] is spec:
            return found[1]
        size = spec_bytes(spec) if measured is None else measured
        self._sizes.share(id(spec), (spec, size))
        return size

    def columns(self, spec: JobSpec, measured: int | None = None) -> tuple[str, str, int]:
        """What a job's row stores beside its spec (display name, request, spec bytes), once per
        shared spec: a sweep's submits all store the same. `measured`: as for `spec_bytes`."""
        found = self._columns.get(id(spec))
        if found is not None and found[0] is spec:
            return found[1]
        values = (display_name(spec), describe_request(spec.request), self.spec_bytes(spec, measured))
        self._columns.share(id(spec), (spec, values))
        return values

    def text(self, value: str) -> str:
        return self._strings.share(value, value)

    def spec(self, spec: JobSpec, stored: str, env_digest: bytes | None = None) -> JobSpec:
        """A spec a client just sent (validated) and its stored JSON (`env_digest`: its environment's,
        stored apart): one object for every job whose spec is the same (the tasks of an array, a
        resubmitted sweep), else its repeated parts shared."""
        key = stored if env_digest is None else (stored, env_digest)
        found = self._specs.get(key)
        if found is not None:
            self._specs.move_to_end(key)
            return found
        # Its fields as spec.model_dump() has them, without the dump (21k instructions of a submit's ~470k):
        # only the request and the dependencies are models, flat ones whose __dict__ is their dump, and
        # _build copies what it does not share (a dependency) or shares it as it comes (the rest).
        fields = spec.__dict__
        return self._specs.share(key, self._build({**fields, "request": fields["request"].__dict__,
                                                   "after": [d.__dict__ for d in fields["after"]]}))

    def spec_from_json(self, text: str, env: tuple[dict[str, str], bytes] | None = None) -> JobSpec:
        """A spec the daemon itself stored: not validated again (it was at submission), unless its
        shape is not exactly today's (a database from an older version), which goes through pydantic.
        `env`: (environment, its digest) when the environment is stored apart and `text` has none."""
        key = text if env is None else (text, env[1])
        found = self._specs.get(key)
        if found is not None:
            self._specs.move_to_end(key)
            return found
        fast = self._from_parts(text, env)
        if fast is not None:
            return self._specs.share(key, fast)
        try:
            # pydantic's own parser, 2.7x json.loads on a spec (a restart parses 100k of them);
            # only keys are worth caching: values are what makes specs distinct.
            data = from_json(text, cache_strings="keys")
        except (ValueError, TypeError):
            data = None
        if env is not None and isinstance(data, dict):
            data["env"] = env[0]  # (a row that names an environment holds none of its own)
        if not isinstance(data, dict) or data.keys() != _SPEC_FIELDS or not _plain(data):
            # (with the environment apart, what was parsed, environment and all: `JobSpec.env` has a
            # default, and a text without one must not validate as an empty environment)
            parsed = JobSpec.model_validate_json(text) if env is None else JobSpec.model_validate(data)
            return self._specs.share(key, self._build(parsed.model_dump()))
        return self._specs.share(key, self._build(data))

    def _from_parts(self, text: str, env: tuple[dict[str, str], bytes] | None) -> JobSpec | None:
        """A stored spec whose argv is all that differs from others already loaded (a sweep submitted job
        by job): argv parsed on its own, the rest of the text parsed once and shared. None: the text is
        not of today's shape, or too long a rest to keep; the caller parses it whole."""
        end = text.find(_ARGV_END)
        if end < 0 or not text.startswith(_ARGV_HEAD) or len(text) - end > _REST_MAX:
            return None
        env_digest = None if env is None else env[1]
        last = self._last_rest
        if (last is not None and last[0] == env_digest and len(text) - end - 2 == len(last[1])
                and text.endswith(last[1])):
            shared = last[2]
        else:
            rest = text[end + 2 :]  # from `"cwd":` to the closing brace
            rest_key = rest if env is None else (rest, env[1])
            if rest_key in self._rests:
                shared = self._rests[rest_key]
            else:
                shared = self._rests.share(rest_key, self._parse_rest(rest, env))
            self._last_rest = (env_digest, rest, shared)
        if shared is None:
            return None
        argv_text = text[len(_ARGV_HEAD) - 1 : end + 1]
        argv = self._argv_texts.get(argv_text)
        if argv is None:
            try:
                parsed = from_json(argv_text)
            except ValueError:
                return None
            if type(parsed) is not list or not parsed:
                return None
            argv = self._argv_texts.share(argv_text, parsed)
        values = shared.copy()  # (argv first, as declared: the template holds its place)
        values["argv"] = argv
        return construct(JobSpec, _SPEC_SET, values)

    def _parse_rest(self, rest: str, env: tuple[dict[str, str], bytes] | None) -> dict[str, Any] | None:
        """Every field of a stored spec, from the text after its argv, shared as _build shares them, with
        a stand-in argv for each job's own; None unless of exactly today's shape (the whole text then
        goes through pydantic)."""
        try:
            data = from_json("{" + rest, cache_strings="keys")
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        if env is not None:
            data["env"] = env[0]
        data["argv"] = ["-"]  # (checked and built with a stand-in, dropped below)
        if data.keys() != _SPEC_FIELDS or not _plain(data):
            return None
        built = self._shared_parts(data)
        return {name: built[name] for name in _SPEC_ORDER}  # a template: `_from_parts` puts each job's argv in

    def _build(self, data: dict[str, Any]) -> JobSpec:
        argv: list[str] = data["argv"]
        data = self._shared_parts(data)
        data["argv"] = self._argvs.share(tuple(argv), argv)
        return construct(JobSpec, _SPEC_SET, {name: data[name] for name in _SPEC_ORDER})

    def _shared_parts(self, data: dict[str, Any]) -> dict[str, Any]:
        """`data` (a spec's fields, plain) with its environment, cwd, name, request and dependencies
        replaced by shared objects; argv is left as it is."""
        env: dict[str, str] = data["env"]
        request: dict[str, Any] = data["request"]
        data["env"] = self._envs.share(tuple(env.items()), env)
        data["cwd"] = self.text(data["cwd"])
        if data["name"] is not None:
            data["name"] = self.text(data["name"])
        key = tuple(request.items())  # in field order: dumped by pydantic, here or into the store
        shared = self._requests.get(key)
        if shared is None:
            kind = _REQUEST_TYPES[request["kind"]]
            shared = self._requests.share(key, kind.model_validate(request))
        data["request"] = shared
        after = data["after"]
        data["after"] = _EMPTY_AFTER if not after else [
            construct(Dependency, _DEPENDENCY_SET, {"job_id": d["job_id"], "condition": d["condition"]}) for d in after
        ]
        return data

    def job(self, *, id: int, uid: int, gid: int, user: str, spec: JobSpec, state: JobState,
            submitted_at: float, started_at: float | None = None, ended_at: float | None = None,
            exit_code: int | None = None, signal: int | None = None, reason: str = "",
            allocation: Allocation | None = None, pid: int | None = None,
            history: list[Transition] | None = None, array_id: int | None = None,
            array_task: int | None = None) -> Job:
        """A Job from trusted parts (the store's own columns, or a spec validated at submission)."""
        return construct(Job, _JOB_SET, {
            "id": id, "uid": uid, "gid": gid, "user": self.text(user), "spec": spec, "state": state,
            "submitted_at": submitted_at, "started_at": started_at, "ended_at": ended_at, "exit_code": exit_code,
            "signal": signal, "reason": self.text(reason), "allocation": allocation, "pid": pid,
            "history": history if history is not None else [], "array_id": array_id, "array_task": array_task,
        })

    def add_histories(self, rows: Iterable[tuple[int, int, str, float, str]], states: dict[str, JobState],
                      out: dict[int, list[Transition]], submitted: dict[int, float]) -> None:
        """Stored transitions (job id, seq, state, at, reason), each job's in order, appended to `out` by
        job id: a Transition for each row, the reason shared as `text` shares it (one call a row less:
        a restart reads 100k rows). A job whose rows start after seq 0 gets its implied first
        transition first (`first_transition`, at its `submitted` time)."""
        share = self._strings.share
        for job_id, seq, state, at, reason in rows:
            transition = construct(Transition, _TRANSITION_SET,
                                   {"state": states[state], "at": at, "reason": share(reason, reason)})
            history = out.get(job_id)
            if history is None:  # (no list made twice)
                out[job_id] = [transition] if seq == 0 else [self.first_transition(submitted[job_id]), transition]
            else:
                history.append(transition)

    @staticmethod
    def first_transition(at: float) -> Transition:
        """The first transition of a job submitted at `at`, which no row stores (schema.FIRST_REASON)."""
        return construct(Transition, _TRANSITION_SET, {"state": JobState.PENDING, "at": at, "reason": FIRST_REASON})


def _plain(data: dict[str, Any]) -> bool:
    """Do the stored values have the shapes a validated spec dumps? (Containers only: a cheap check
    against a database written by another version, not validation; anything odd goes through pydantic.)"""
    request, after = data["request"], data["after"]
    return (isinstance(data["env"], dict) and isinstance(data["argv"], list) and bool(data["argv"])
            and isinstance(data["cwd"], str) and (data["name"] is None or isinstance(data["name"], str))
            and isinstance(request, dict) and request.get("kind") in _REQUEST_TYPES
            and isinstance(after, list) and all(isinstance(d, dict) and d.keys() == _DEPENDENCY_SET for d in after))
