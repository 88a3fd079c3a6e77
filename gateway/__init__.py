"""kdamesh gateway: the OpenAI-compatible REST and gRPC front of the mesh.

Modules: `app` (FastAPI routes, SSE), `grpc_api` (the `kdamesh.v1.Generation` servicer), `chat_service` (the
pipeline both share: auth -> render -> admit -> mesh -> parse), `openai_protocol` (request validation, the error
envelope), `config` (`GatewayConfig`), `mesh_client` (P/D decision, prefill -> decode over gRPC), `routing`
(prefix- and load-aware worker choice), `tenancy` (API keys, cache salts), `ratelimit` (per-tenant limits),
`metrics` (Prometheus). Subpackages: `gateway.chat` renders chat conversations to prompt token ids (the Kimi K3 XTML
program and the Kimi Linear/K2 Jinja2 template); `gateway.parsers` turns generated text back into reasoning, content
and tool calls. Nothing here imports torch.
"""
