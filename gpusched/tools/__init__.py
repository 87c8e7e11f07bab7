"""Operator tools that are run by hand (not by the daemon), e.g. `python -m gpusched.tools.hardware_check`."""
