"""Backend-neutral core of divjac: patterns, coloring and estimator math (no framework)."""
