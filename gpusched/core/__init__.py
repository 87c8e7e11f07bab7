"""Policy: pure scheduling decisions (no I/O, time passed in)."""
