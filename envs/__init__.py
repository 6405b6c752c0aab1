"""Task environments, one file per task (Gymnasium-style docstring as each env's spec)."""
