"""Scoring: one call's distributed plan above, one batch's engine below. ``pipeline`` runs a loglikelihood or
rolling call (the global plan, its batches through the executor, the float64 gather); ``engine/`` scores one batch of
rows exactly and imports nothing of the plan above it (tests/test_layout.py)."""
