"""Observability across the in-process mesh: traces, /metrics, JSON logs, graceful drain (see harness.py)."""
