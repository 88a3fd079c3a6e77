"""kdamesh gateway: the OpenAI-compatible front of the mesh.

Subpackages: `gateway.chat` renders chat conversations to prompt token ids (the Kimi K3 XTML program and the Kimi
Linear/K2 Jinja2 template); `gateway.parsers` turns generated text back into reasoning, content and tool calls. Neither
imports torch.
"""
