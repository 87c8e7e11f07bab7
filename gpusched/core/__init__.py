"""Policy: pure scheduling decisions (no I/O, time passed in).

When `python -m gpusched.native build` has compiled these modules and they still match their
sources, the compiled ones are imported instead (gpusched/native.py); `NATIVE` says which.
"""

from gpusched.native import core_path

NATIVE: bool = core_path(__path__)
