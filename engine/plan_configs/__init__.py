"""Configs of the released models (the released shapes in docs/architecture.md) for `kdamesh plan`; no weights."""
