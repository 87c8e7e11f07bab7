"""Slurm integration: gres.conf export, job hooks, relayout and drain-on-fault (docs/slurm.md)."""
