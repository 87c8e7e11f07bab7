"""Mechanism for GPUs, behind one interface (backend.py)."""
