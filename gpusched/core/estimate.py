"""Run-time estimates from history: per user and command, per command, per user and shape, per shape.

Why estimates at all: a GPU scheduler that knows nothing of when running jobs end can only hold
the fairness head's devices forever (the node drains) or never (the head starves). Users rarely
give `--time`, and when they do it is an upper bound, not a forecast. So, like the predictors of
Tsafrir et al. ("Backfilling using system-generated predictions rather than user runtime
estimates", 2007), we predict from the user's own recent history: the mean of the last few run
times of the most specific key that has any, falling back to broader keys and finally a default.

Two rules keep a wrong estimate from doing lasting harm:
- `--time` caps every estimate (the job is killed there, so it cannot run longer);
- a running job's estimate is never below `elapsed_factor` x its elapsed time, so a job that
  outlives its estimate is expected to run on (for as long again), and a reservation that counted
  on it ending moves later instead of holding devices for an end that is not coming.

Pure: run times are given by the caller; nothing here reads a clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpusched.model import Job, JobSpec, MigRequest, PartitionRequest, ShareRequest, WholeRequest

_COMMAND_CHARS = 256  # a command key is bounded: argv can be megabytes
_ZEROS = (0,) * 8  # the default version of each key (an estimate looks at five)
_MEMO_MAX = 8192  # memoised estimates (and key tuples) kept before the memo is cleared


@dataclass(frozen=True, slots=True)
class EstimatorConfig:
    """Estimator knobs; the daemon builds this from `[scheduler]` in its TOML."""

    default_runtime_s: float = 3600.0  # a job nothing is known about
    history: int = 8  # run times remembered per key (mean of these)
    elapsed_factor: float = 2.0  # k: a running job is expected to run at least k x its elapsed time
    max_keys: int = 50_000  # keys kept (least recently used dropped first), bounding memory

    def __post_init__(self) -> None:
        if self.default_runtime_s <= 0:
            raise ValueError("default_runtime_s must be > 0")
        if self.history < 1:
            raise ValueError("history must be >= 1")
        if self.elapsed_factor < 1:
            raise ValueError("elapsed_factor must be >= 1")
        if self.max_keys < 1:
            raise ValueError("max_keys must be >= 1")


def command_key(job: Job) -> str:
    """What 'the same command' means: the job's name if it has one, else its argv (bounded)."""
    return _spec_command_key(job.spec)


def _spec_command_key(spec: JobSpec) -> str:
    if spec.name:
        return "n:" + spec.name[:_COMMAND_CHARS]
    return "a:" + "\x00".join(spec.argv)[:_COMMAND_CHARS]


def shape_key(request: WholeRequest | MigRequest | ShareRequest | PartitionRequest) -> str:
    """What 'the same request shape' means: whole count, MIG profile, or share fraction (2 digits)."""
    if isinstance(request, WholeRequest):
        return f"gpus={request.gpus}"
    if isinstance(request, MigRequest):
        return f"mig={request.profile}"
    if isinstance(request, PartitionRequest):
        return f"partition={request.mode}x{request.gpus}"
    return f"share={request.fraction:.2f}"


def _keys(user: str, cmd: str, shape: str) -> tuple[str, ...]:
    """The keys an estimate looks at, most specific first; `cmd` "" (a command with no history)
    gives "" for the command keys, which are never in the history."""
    by_cmd = (f"u\x00{user}\x00{cmd}", f"c\x00{cmd}") if cmd else ("", "")
    return (*by_cmd, f"s\x00{user}\x00{shape}", f"S\x00{shape}", "*")


def _command_of(key: str) -> str | None:
    """The command a history key names (`c\\0CMD`, `u\\0USER\\0CMD`), None for shape and global keys."""
    if key.startswith("c\x00"):
        return key[2:]
    if key.startswith("u\x00"):
        parts = key.split("\x00", 2)
        return parts[2] if len(parts) == 3 else None
    return None


_SOURCES = ("your previous runs of this command", "previous runs of this command",
            "your previous jobs of this shape", "previous jobs of this shape", "recent jobs")


@dataclass(frozen=True, slots=True)
class Estimate:
    """An estimate and where it came from (for `gpusched show`)."""

    seconds: float
    source: str


class RuntimeEstimator:
    """Recent run times by key; `predict` for a job not yet started, `expected_total` for a running one."""

    def __init__(self, config: EstimatorConfig | None = None) -> None:
        self.config = config or EstimatorConfig()
        self._runs: OrderedDict[str, deque[float]] = OrderedDict()
        # A pass asks for the same jobs' estimates many times: answers are memoised per job with the
        # versions of the keys they were read from, so a job's end invalidates only the estimates
        # that depend on its own keys.
        self._versions: dict[str, int] = {}
        # Memoised per (keys, time limit), not per job, and bounded: a pass asks only for the heads of
        # the users' queues, so 100k queued jobs need no entry each here (a miss costs microseconds).
        self._key_tuples: dict[tuple[str, str, str], tuple[str, ...]] = {}
        self._job_keys: dict[int, tuple[str, ...]] = {}  # the jobs asked about lately (the heads, mostly)
        # An answer depends only on the keys up to the one it was read from (the more specific ones
        # were empty, the broader ones were not looked at): only their versions are kept, so the end
        # of some other user's job (which moves the shape and global keys) leaves it valid. With them
        # the revision they were last checked at: while nothing has been learned since, they still
        # hold without reading each again (a restart asks for 100k queued jobs in a row).
        self._memo: dict[tuple[tuple[str, ...], float | None], tuple[int, tuple[int, ...], Estimate]] = {}
        # Commands with any history (live keys naming them). 100k queued jobs of a sweep are mostly
        # commands never seen: their estimate is their shape's, shared, with no per-command keys.
        self._cmds: dict[str, int] = {}
        # Bumped whenever anything is learned: an unchanged revision means every estimate is as it
        # was, which lets callers keep values derived from estimates (the queue's deadlines).
        self.revision = 0

    def observe(self, job: Job, runtime_s: float) -> None:
        """A job ran `runtime_s` seconds and ended on its own (completed, failed, or hit its limit)."""
        if runtime_s < 0 or runtime_s != runtime_s:  # negative or NaN: a clock jump, not a run time
            return
        for key in _keys(job.user, command_key(job), shape_key(job.spec.request)):
            self._remember(key, runtime_s)

    def _remember(self, key: str, runtime_s: float) -> None:
        # A version is a stamp never given before (not a per-key count): a key dropped and learned
        # again must not match a memo taken in its earlier life.
        self.revision += 1
        self._versions[key] = self.revision
        runs = self._runs.get(key)
        if runs is None:
            runs = deque(maxlen=self.config.history)
            self._runs[key] = runs
            cmd = _command_of(key)
            if cmd is not None:
                if cmd not in self._cmds:
                    self._job_keys.clear()  # jobs cached as "never seen" must look at this command now
                self._cmds[cmd] = self._cmds.get(cmd, 0) + 1
            while len(self._runs) > self.config.max_keys:
                dropped, _ = self._runs.popitem(last=False)
                # Back to "never seen": a memo taken while it was absent is right again (and the
                # version table stays as bounded as the history).
                self._versions.pop(dropped, None)
                gone = _command_of(dropped)
                if gone is not None:
                    left = self._cmds.get(gone, 1) - 1
                    if left > 0:
                        self._cmds[gone] = left
                    else:
                        self._cmds.pop(gone, None)
        else:
            self._runs.move_to_end(key)
        runs.append(runtime_s)

    def estimate(self, job: Job) -> Estimate:
        """Expected run time of a job that has not started: history, capped by its time limit."""
        spec = job.spec  # (read once: each read of a model's field is a lookup when compiled)
        keys = self._job_keys.get(job.id)
        if keys is None:
            cmd = _spec_command_key(spec)
            # A command with no history at all: only the shape's keys can answer ("" is no key).
            parts = (job.user, cmd if cmd in self._cmds else "", shape_key(spec.request))
            keys = self._key_tuples.get(parts)
            if keys is None:
                if len(self._key_tuples) >= _MEMO_MAX:
                    self._key_tuples.clear()
                keys = self._key_tuples[parts] = _keys(*parts)
            if len(self._job_keys) >= _MEMO_MAX:
                self._job_keys.clear()
            self._job_keys[job.id] = keys
        memo_key = (keys, spec.time_limit_s)
        memo = self._memo.get(memo_key)
        revision = self.revision
        if memo is not None:
            if memo[0] == revision:  # nothing learned since its versions were read: they are as they were
                return memo[2]
            if memo[1] == tuple(map(self._versions.get, keys[: len(memo[1])], _ZEROS)):
                self._memo[memo_key] = (revision, memo[1], memo[2])
                return memo[2]
        answer, depth = self._estimate(job, keys)
        if len(self._memo) >= _MEMO_MAX:
            self._memo.clear()
        self._memo[memo_key] = (revision, tuple(map(self._versions.get, keys[:depth], _ZEROS)), answer)
        return answer

    def _estimate(self, job: Job, keys: tuple[str, ...]) -> tuple[Estimate, int]:
        """The estimate, and how many of `keys` it depends on (up to the one that answered)."""
        limit = job.spec.time_limit_s
        value, source = self.config.default_runtime_s, "no history yet (the default)"
        depth = len(keys)
        for i, (key, key_source) in enumerate(zip(keys, _SOURCES, strict=True)):
            runs = self._runs.get(key)
            if runs:
                value, source = sum(runs) / len(runs), key_source
                depth = i + 1
                break
        if limit is not None and limit < value:
            return Estimate(float(limit), "its time limit"), depth
        return Estimate(value, source), depth

    def predict(self, job: Job) -> float:
        return self.estimate(job).seconds

    def expected_total(self, job: Job, predicted_s: float, elapsed_s: float) -> float:
        """Expected total run time of a job running for `elapsed_s`: never below k x elapsed, never
        above its time limit."""
        total = max(predicted_s, self.config.elapsed_factor * max(0.0, elapsed_s))
        limit = job.spec.time_limit_s
        return min(total, float(limit)) if limit is not None else total

    # ---- persistence ---------------------------------------------------------------------
    def export_history(self) -> dict[str, list[float]]:
        """Plain data the daemon persists with the fair-share standing (bounded by max_keys x history)."""
        return {key: list(runs) for key, runs in self._runs.items()}

    def load_history(self, saved: Mapping[str, Sequence[float]]) -> None:
        """Restore what export_history gave; entries that are not lists of numbers are skipped."""
        for key, runs in saved.items():
            if not isinstance(key, str) or not isinstance(runs, (list, tuple)):
                continue
            for value in runs[-self.config.history:]:
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
                    self._remember(key, float(value))
