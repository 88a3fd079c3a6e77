"""The text rules of the chat formats, shared by the engine and the gateway, in plain Python (no torch, no numpy).

- `engine.formats.markers`: the special-token strings of the two chat formats — Kimi K3 "XTML" (`<|open|>`,
  `<|close|>`, `<|sep|>`, `<|end_of_msg|>`, the media markers) and Kimi K2 / Kimi Linear (`<think>`, the tool-call
  section markers, `<|im_end|>`, the role markers) — the one place these strings are spelled.
- `engine.formats.stop`: `StopMatcher`, how stop strings end a growing output text and how much of a stream must be
  held back so that a stop string is never emitted.

Importing this package (or either module) loads nothing but the standard library; the gateway relies on that.
"""
