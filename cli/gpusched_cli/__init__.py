"""gpusched command-line client."""
