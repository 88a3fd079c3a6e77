"""Observability shared by every kdamesh service: traces, metrics, structured logs and the request id.

Modules (each imports only OpenTelemetry, prometheus_client, grpc (with its health and reflection packages) and the
standard library — never the engine or a service, so any layer may use it):
- `telemetry.context`: the request id of the call being handled (a contextvar) and its `x-request-id` header name.
- `telemetry.tracing`: `setup_tracing` (one tracer provider per process: OTLP, console or nothing), span helpers with
  kdamesh's attribute names, the gateway's GenAI root span and W3C `traceparent` extraction.
- `telemetry.rpc`: gRPC `grpc.aio` server and client interceptors: W3C trace context (`traceparent`) and the
  request id (`x-request-id`) in call metadata, a SERVER span per call, per-call status counts and an access log line.
- `telemetry.metrics`: the Prometheus series of each service, in a `CollectorRegistry` the caller owns, and the
  side HTTP `/metrics` server of the gRPC services.
- `telemetry.grpc_server`: the `grpc.aio` server every kdamesh service runs, with standard health (NOT_SERVING until
  the service says otherwise) and reflection.
- `telemetry.logs`: text or JSON log lines carrying the request id and trace id, and the gateway's one-line-per-request
  `log_request`.
- `telemetry.units`: `parse_bytes`, the one byte-size rule of every command line and config (`4GiB`, `512M`, `2GB`);
  here because every layer may import this package.
"""
