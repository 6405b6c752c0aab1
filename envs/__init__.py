"""Task environments, one module or package per task (Gymnasium-style docstring as each env's spec)."""
