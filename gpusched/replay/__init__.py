"""Trace replay through the same core under a virtual clock."""
