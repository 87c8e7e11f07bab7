"""Policies as plug-ins (docs/policies.md): the loader's checks, each refusal naming the field and
the problem, and the example policy replayed beside the built-ins."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpusched.config import DaemonConfig
from gpusched.core.scheduler import Scheduler
from gpusched.model import JobState
from gpusched.policies import BUILTINS, PolicyError, load_policy
from gpusched.policy import Explains, Incremental, OrdersByFairness, Policy, PolicyContext
from gpusched.replay import runner
from gpusched_cli.commands.replay import replay as replay_command

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"
FIXTURE = str(ROOT / "tests" / "fixtures" / "alibaba-openb-sample.csv")
EXAMPLE = "smallest_first:SmallestFirst"

PLUGINS = '''
from gpusched.core.fifo import FifoScheduler

class Good:
    name = "good"
    def __init__(self, context):
        self.options = dict(context.options)
        self.inner = FifoScheduler()
    def plan(self, snapshot, now):
        return self.inner.plan(snapshot, now)

class NoPlan:
    def __init__(self, context): pass

class Broken:
    def __init__(self, context):
        raise RuntimeError("no licence server")
    def plan(self, snapshot, now):
        return []

class HalfIncremental:
    incremental = True
    def __init__(self, context): pass
    def plan(self, snapshot, now):
        return []

def factory(context):
    return Good(context)

def plan_less_factory(context):
    return object()

NOT_CALLABLE = 3
'''


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of policies good and bad, importable as `site_policies_<n>` (fresh per test)."""
    name = f"site_policies_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGINS))
    (tmp_path / "raises_on_import.py").write_text("raise ImportError('needs the site licence module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.fixture
def examples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_builtins_go_through_the_same_door() -> None:
    for name in BUILTINS:
        factory = load_policy(name)
        assert factory.builtin and factory.name == name
        assert isinstance(factory.make(PolicyContext(options={"replicas": 2})), Policy)
    fair = load_policy("gpusched").make(PolicyContext())
    assert isinstance(fair, Scheduler) and fair.incremental
    assert isinstance(fair, Incremental | Explains | OrdersByFairness)
    assert [n for n in BUILTINS if load_policy(n).daemon] == ["gpusched"]


def test_a_plugin_class_and_a_factory_load_with_their_options(plugins: str) -> None:
    factory = load_policy(f"{plugins}:Good")
    assert (factory.name, factory.builtin, factory.daemon) == ("good", False, True)
    policy = factory.make(PolicyContext(options={"k": 1}))
    assert policy.options == {"k": 1}  # type: ignore[attr-defined]
    assert not isinstance(policy, Explains | OrdersByFairness | Incremental)
    assert load_policy(f"{plugins}:factory").name == f"{plugins}:factory"  # no `name`: the spec


@pytest.mark.parametrize(("spec", "problem"), [
    ("", "give a built-in policy"),
    ("fifo", "is neither a built-in policy (gpusched, fifo-whole, fifo-timeslice, static-mig) nor of the form "
             "package.module:Class"),
    ("site policies:Good", "nor of the form package.module:Class"),
    ("no_such_site_module_xyz:Policy", "cannot import module 'no_such_site_module_xyz' for policy "
                                       "'no_such_site_module_xyz:Policy': ModuleNotFoundError: No module named"),
    ("raises_on_import:Policy", "cannot import module 'raises_on_import' for policy 'raises_on_import:Policy': "
                                "ImportError: needs the site licence module"),
    ("{m}:Missing", "module '{m}' has no attribute 'Missing'"),
    ("{m}:NOT_CALLABLE", "'{m}:NOT_CALLABLE' is a int, not a policy class"),
    ("{m}:NoPlan", "class '{m}:NoPlan' has no plan(snapshot, now) method"),
])
def test_a_bad_spec_is_refused_naming_the_field_and_problem(plugins: str, spec: str, problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(spec.format(m=plugins), field="scheduler.policy")
    message = str(caught.value)
    assert message.startswith("scheduler.policy: ") and problem.format(m=plugins) in message, message


@pytest.mark.parametrize(("attr", "problem"), [
    ("Broken", "could not be constructed: RuntimeError: no licence server"),
    ("plan_less_factory", "built a object without a plan(snapshot, now) method"),
    ("HalfIncremental", "says incremental = True but lacks submit(job) or remove(job_id)"),
])
def test_a_policy_that_cannot_be_built_is_refused(plugins: str, attr: str, problem: str) -> None:
    factory = load_policy(f"{plugins}:{attr}", field="--policy")  # it loads: the class itself looks right
    with pytest.raises(PolicyError) as caught:
        factory.make(PolicyContext())
    assert str(caught.value).startswith("--policy: ") and problem in str(caught.value), str(caught.value)


def test_the_config_checks_the_form_and_the_daemon_the_rest() -> None:
    """Reading the file checks the form only (a client reading it imports nothing); gpuschedd's start
    imports and builds it (tests/integration/test_policy_plugin.py)."""
    base = {"socket": "/tmp/x.sock", "state_dir": "/tmp/x"}
    assert DaemonConfig(**base).scheduler.policy == "gpusched"
    assert DaemonConfig(**base, scheduler={"policy": " site.mod:Cls "}).scheduler.policy == "site.mod:Cls"
    with pytest.raises(ValueError, match=r"scheduler\.policy\n.*'fifo' is neither a built-in policy"):
        DaemonConfig(**base, scheduler={"policy": "fifo"})


def test_resolve_policies_takes_lists_and_plugins(examples: None) -> None:
    assert runner.resolve_policies("all") == ["gpusched", "fifo-whole", "fifo-timeslice", "static-mig"]
    assert runner.resolve_policies(f"fifo-whole,{EXAMPLE},fifo-whole") == ["fifo-whole", EXAMPLE]
    with pytest.raises(PolicyError, match=r"^--policy: 'nope' is neither"):
        runner.resolve_policies("gpusched,nope")


def test_the_example_replays_beside_the_builtins(examples: None) -> None:
    report = runner.run_replay(FIXTURE, policies=runner.resolve_policies(f"all,{EXAMPLE}"))
    by_name = {s["policy"]: s for s in report.summaries}
    assert list(by_name) == ["gpusched", "fifo-whole", "fifo-timeslice", "static-mig", "smallest-first"]
    result = report.results[-1]
    assert result.stuck == 0 and result.unsatisfiable == 0
    assert result.jobs and all(j.state is JobState.COMPLETED for j in result.jobs)  # every job ends
    mine = by_name["smallest-first"]
    assert mine["jobs"] == by_name["fifo-whole"]["jobs"] and float(mine["utilization"]) > 0  # type: ignore[arg-type]
    assert "smallest-first" in runner.render_table(report)


def test_replay_cli_reports_the_plugin_in_json_and_refuses_a_bad_one(examples: None) -> None:
    cli = CliRunner()
    res = cli.invoke(replay_command, [FIXTURE, "--policy", f"fifo-whole,{EXAMPLE}", "--json"])
    assert res.exit_code == 0, res.output
    assert [json.loads(line)["policy"] for line in res.output.splitlines()] == ["fifo-whole", "smallest-first"]
    bad = cli.invoke(replay_command, [FIXTURE, "--policy", "no_such_site_module_xyz:P"])
    assert bad.exit_code == 2 and "--policy: cannot import module 'no_such_site_module_xyz'" in bad.output


def test_the_docs_show_the_tested_example() -> None:
    """docs/policies.md includes the example module verbatim, so what a reader copies is what is tested."""
    doc = (ROOT / "docs" / "policies.md").read_text()
    assert (EXAMPLES / "smallest_first.py").read_text() in doc


def test_the_example_passes_the_linters() -> None:
    for tool in (["ruff", "check"], ["mypy", "--strict"]):
        res = subprocess.run([str(Path(sys.executable).parent / tool[0]), *tool[1:], str(EXAMPLES)],
                             capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 0, res.stdout + res.stderr


def test_a_restart_hands_its_queue_over_at_once_only_through_a_submit_many_of_the_same_class() -> None:
    """submit_all: a policy whose submit_many was written with its submit takes the queue in one call;
    one that overrides only submit (a plug-in subclassing the built-in) sees every job through it."""
    from gpusched.policy import submit_all

    calls: list[tuple[str, list[int]]] = []

    class Many:
        incremental = True

        def submit(self, job: Any) -> None:
            calls.append(("submit", [job]))

        def remove(self, job_id: int) -> None: ...

        def submit_many(self, jobs: list[Any]) -> None:
            calls.append(("submit_many", list(jobs)))

    class OverridesSubmit(Many):
        def submit(self, job: Any) -> None:
            calls.append(("own submit", [job]))

    class OverridesBoth(OverridesSubmit):
        def submit_many(self, jobs: list[Any]) -> None:
            calls.append(("own submit_many", list(jobs)))

    for policy, expected in ((Many(), [("submit_many", [1, 2])]),
                             (OverridesSubmit(), [("own submit", [1]), ("own submit", [2])]),
                             (OverridesBoth(), [("own submit_many", [1, 2])])):
        calls.clear()
        submit_all(policy, [1, 2])  # type: ignore[list-item]
        assert calls == expected, type(policy).__name__
    from gpusched.policy import _submit_many_is_current
    assert _submit_many_is_current(Scheduler)  # the built-in, compiled or not
