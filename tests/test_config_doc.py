"""docs/config.md and systemd/gpusched.toml stay true to DaemonConfig; config errors say where."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from gpusched import config_doc
from gpusched.config import ConfigError, DaemonConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "systemd" / "gpusched.toml"
# `#key = value` and `#[table]` (no space after the #) are settings to uncomment; `# text` is prose.
EXAMPLE_LINE = re.compile(r"^#(?=\[|[A-Za-z_][\w.]* = )", re.MULTILINE)


def test_config_reference_is_current() -> None:
    current = config_doc.DEFAULT_PATH.read_text(encoding="utf-8")
    if current != config_doc.render():
        pytest.fail(f"{config_doc.DEFAULT_PATH} differs from gpusched/config.py; regenerate it with "
                    f"`{config_doc.REGENERATE}` (from the repository root)")
    assert config_doc.main(["--check"]) == 0


def test_check_fails_on_a_stale_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "config.md"
    stale.write_text("# old\n", encoding="utf-8")
    assert config_doc.main(["--check", str(stale)]) == 1
    assert config_doc.REGENERATE in capsys.readouterr().err
    assert config_doc.main([str(stale)]) == 0
    assert config_doc.main(["--check", str(stale)]) == 0


def test_reference_documents_every_key_with_its_default() -> None:
    text = config_doc.render()
    for name, field in DaemonConfig.model_fields.items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} missing from the reference"
        assert field.description and field.description.split(";")[0].replace("|", "\\|") in row
    assert "| `share` | one of \"exclusive\", \"mps\", \"timeslice\" | `\"exclusive\"` |" in text
    assert "| `kill_grace_s` | float, 0.0 <= x <= 3600.0 | `10.0` |" in text
    assert "root: `/run/gpusched/gpusched.sock`" in text


def test_example_config_loads_as_shipped_with_the_defaults() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    config = load_config(str(EXAMPLE), uid=0, env={})
    active = tomllib.loads(text)
    for key, value in active.items():
        field = DaemonConfig.model_fields[key]
        if field.default_factory is not None:  # a [section]: what it sets must be the section's defaults
            default = field.default_factory().model_dump()  # type: ignore[call-arg]
            assert value == {k: default[k] for k in value}, f"{EXAMPLE}: [{key}] is not the default {default!r}"
        elif field.default is not None and not field.is_required():
            assert value == field.default, f"{EXAMPLE}: {key} = {value!r} is not the default {field.default!r}"
    assert config.socket == "/run/gpusched/gpusched.sock" and config.state_dir == "/var/lib/gpusched"
    assert config.sim is None and config.metrics_address is None  # nothing optional is switched on


def test_example_config_shows_every_key(tmp_path: Path) -> None:
    """Every top-level key is set, or set once its example line is uncommented: a new key needs an example."""
    uncommented = tmp_path / "gpusched.toml"
    uncommented.write_text(EXAMPLE_LINE.sub("", EXAMPLE.read_text(encoding="utf-8")), encoding="utf-8")
    missing = sorted(set(DaemonConfig.model_fields) - set(tomllib.loads(uncommented.read_text(encoding="utf-8"))))
    assert not missing, f"{EXAMPLE} has no line for {missing}: add `key = default` or `#key = example` with a comment"
    config = load_config(str(uncommented), uid=0, env={})  # the examples are valid values too
    assert set(config.model_fields_set) == set(DaemonConfig.model_fields)
    assert config.gpus["0"].mig and config.gpus["1"].share == "mps" and config.metrics_address is not None


def test_every_example_key_has_a_comment_above_it() -> None:
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^#?([a-z_]+) = ", line)
        if m and m.group(1) in DaemonConfig.model_fields:
            above = lines[i - 1] if i else ""
            assert above.startswith("# "), f"{EXAMPLE}:{i + 1}: {m.group(1)} has no comment above it"


def test_bad_value_names_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "gpusched.toml"
    path.write_text('tick_s = 1.0\nkill_grace_s = "soon"\n[gpus.0]\nshare = "sometimes"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_config(str(path), uid=0, env={})
    message = str(err.value)
    assert message.startswith(f"{path}: invalid configuration: ")
    assert "kill_grace_s: " in message and "gpus.0.share: " in message
    path.write_text("tick_s = 1.0\nno_such_key = 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"no_such_key: Extra inputs are not permitted"):
        load_config(str(path), uid=0, env={})


def test_checkpoint_moves_is_true_false_or_auto(tmp_path: Path) -> None:
    path = tmp_path / "gpusched.toml"
    for text, expected in (("true", True), ("false", False), ('"auto"', "auto")):
        path.write_text(f"checkpoint_moves = {text}\n", encoding="utf-8")
        assert load_config(str(path), uid=0, env={}).checkpoint_moves == expected
    assert load_config(None, uid=0, env={}).checkpoint_moves == "auto"
    for bad in ('"yes"', "1", '"Auto"'):
        path.write_text(f"checkpoint_moves = {bad}\n", encoding="utf-8")
        with pytest.raises(ConfigError, match=r'checkpoint_moves: Value error, must be true, false or "auto"'):
            load_config(str(path), uid=0, env={})


def test_toml_syntax_error_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "gpusched.toml"
    path.write_text('tick_s = 1.0\n\nadmin_group = "gpu\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: not valid TOML: .*line 3"):
        load_config(str(path), uid=0, env={})


def test_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: cannot read config file"):
        load_config(str(path), uid=0, env={})
