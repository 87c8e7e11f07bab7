"""`--plot`: utilization over time and per-user service, one line / bar group per policy.

matplotlib is an optional dependency (extra `replay`), imported only here and only when asked for,
so replays without a plot and the client never pay for it.
"""

from __future__ import annotations

import io
from typing import Any

from gpusched.replay.metrics import user_service, utilization_series
from gpusched.replay.runner import ReplayReport


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def write_plot(report: ReplayReport, path: str) -> None:
    """Write a PNG with two panels: utilization over time, and GPU-hours per user per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'gpusched[replay]'") from None
    fig: Any
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8))
    for r in report.results:
        xs, ys = utilization_series(r)
        top.plot([(x - r.start) / 86400 for x in xs], ys, label=r.policy, linewidth=1)
    top.set_xlabel("days since the first arrival")
    top.set_ylabel("allocated fraction of GPUs")
    top.set_ylim(0, 1.05)
    top.set_title(f"Utilization over time ({report.gpus})")
    top.legend(loc="lower right", fontsize="small")
    users = report.trace.users()
    n = max(1, len(report.results))
    width = 0.8 / n
    for k, r in enumerate(report.results):
        service = user_service(r)
        bottom.bar([i + k * width for i in range(len(users))], [service.get(u, 0.0) / 3600 for u in users],
                   width=width, label=r.policy)
    bottom.set_xticks([i + 0.4 - width / 2 for i in range(len(users))])
    bottom.set_xticklabels(users, rotation=60, fontsize="small")
    bottom.set_ylabel("GPU-hours received")
    bottom.set_title("Service per user")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    image = io.BytesIO()  # drawn in memory, then written: matplotlib does not report every write error
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    with open(path, "wb") as out:  # OSError (no such directory, a full disk) for the caller to report
        out.write(image.getvalue())
