"""kdamesh gateway: the OpenAI-compatible REST and gRPC front of the mesh.

Modules, by job:
- fronts: `app` (the FastAPI app, its routes and /openapi.json), `rest_routes` (one handler per endpoint),
  `rest_io` (request bodies, disconnects, shutdown, SSE), `rest_responses` (OpenAI response bodies), `grpc_api`
  (the `kdamesh.v1.Generation` servicer), `grpc_translate` (gRPC requests -> REST bodies, events -> messages);
  `handler` (the one skeleton both fronts run a generation request through);
- the pipeline: `core` (`GatewayCore`: auth -> plan -> admit -> run), `protocol` (request validation, the error
  envelope), `plan` (rendering, sampling, structured output, parsers), `run` / `chat_run` / `completion_run` (a
  request through the mesh, seeing the gateway through a `RunContext`), `text` (detokenisation and stop rules of a
  choice), `events`, `request_trace` (telemetry of one request);
- around it: `config` (`GatewayConfig`), `worker_pool` (channels, membership, health, KV-event subscriptions,
  the workers' reported facts), `mesh_client` (the request orchestrator over the pools: P/D decision, prefill ->
  decode over gRPC), `routing` (prefix- and
  load-aware worker choice, the P/D decision), `tenancy` (API keys, cache salts), `ratelimit` (per-tenant limits),
  `metrics` (Prometheus).
Subpackages: `gateway.chat` renders chat conversations to prompt token ids (the Kimi K3 XTML program and the Kimi
Linear/K2 Jinja2 template); `gateway.parsers` turns generated text back into reasoning, content and tool calls.
Nothing here imports torch.
"""
