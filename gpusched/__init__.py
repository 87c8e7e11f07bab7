"""gpusched: a fair, MIG- and MPS-aware GPU scheduler for one shared node."""

__version__ = "0.1.0"
