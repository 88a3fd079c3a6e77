"""Configs of the released models (values from shared/DESIGN.md) for `kdamesh plan`; no weights."""
