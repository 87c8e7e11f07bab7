"""Every simulated model is named wherever a user is told which models exist (the CLI may not import
gpu/, so its help text carries a copy: this test keeps the copies honest)."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from gpusched.config import DaemonConfig
from gpusched.daemon.main import cli as daemon_cli
from gpusched.gpu.amd_profiles import AMD_MODEL_KEYS
from gpusched.gpu.profiles import MODEL_KEYS
from gpusched_cli.main import cli as client_cli

ROOT = Path(__file__).resolve().parents[2]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_help_and_docs_list_every_model() -> None:
    texts = {
        "gpuschedd --help": CliRunner().invoke(daemon_cli, ["--help"]).output,
        "gpusched replay --help": CliRunner().invoke(client_cli, ["replay", "--help"]).output,
        "config sim": str(DaemonConfig.model_fields["sim"].description),
        "docs/admin-guide.md": (ROOT / "docs/admin-guide.md").read_text(),
        "docs/replay.md": (ROOT / "docs/replay.md").read_text(),
        "docs/gpu.md": (ROOT / "docs/gpu.md").read_text(),
        "docs/hardware-notes.md": (ROOT / "docs/hardware-notes.md").read_text(),
        "docs/user-guide.md": (ROOT / "docs/user-guide.md").read_text(),
        "systemd/gpusched.toml": (ROOT / "systemd/gpusched.toml").read_text(),
    }
    for where, text in texts.items():
        missing = [m for m in MODEL_KEYS if m not in _flat(text)]
        assert not missing, f"{where} does not name {missing}"
    for where in ("gpuschedd --help", "gpusched replay --help", "config sim", "docs/admin-guide.md", "docs/replay.md",
                  "docs/gpu.md", "docs/user-guide.md"):
        missing = [m for m in AMD_MODEL_KEYS if m not in _flat(texts[where])]
        assert not missing, f"{where} does not name the AMD model(s) {missing}"


def test_daemon_accepts_every_model_spec() -> None:
    from gpusched.gpu.nvml import open_backend

    b = open_backend(",".join(f"{m}:2" for m in MODEL_KEYS))
    inv = b.inventory()
    assert [g.model for g in inv.gpus] == [m for m in MODEL_KEYS for _ in range(2)] and inv.errors == {}
    b.close()


def test_daemon_accepts_every_amd_model_spec() -> None:
    from gpusched.gpu.opener import open_gpu

    b, name = open_gpu(",".join(f"{m}:2" for m in AMD_MODEL_KEYS))
    inv = b.inventory()
    assert name == "sim-amdsmi"
    assert [g.model for g in inv.gpus] == [m for m in AMD_MODEL_KEYS for _ in range(2)] and inv.errors == {}
    b.close()
