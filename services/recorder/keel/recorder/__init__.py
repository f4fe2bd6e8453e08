"""The recorder: persists every event exactly once and keeps the read models (projections) current."""
