"""Log lines: plain text or one JSON object per line, both carrying the request id and the trace id.

Contract:
- `setup_logging(level, fmt, service)` configures the root logger for a process: one handler on stderr (or `stream`),
  replacing earlier handlers; fmt "text" (`time level logger [request id]: message`) or "json". Returns the handler.
- `RequestContextFilter` (installed by `setup_logging`; add it to any other handler) gives every record
  `request_id` (`telemetry.context`; "-" in text when none), `trace_id` / `span_id` (the current span's, when valid)
  and `service`.
- `JsonFormatter`: `{"time", "level", "logger", "message", "service", "request_id", "trace_id", "span_id", ...}` plus
  `exception` (the formatted traceback) when there is one and every structured field passed as `extra` (dicts such as
  `rpc` from `telemetry.rpc`, `request` from `log_request`). Keys whose value is None are left out.
- `log_request(...)`: the gateway's one line per API request, on the `kdamesh.request` logger at INFO: request id,
  tenant, model, endpoint, HTTP status, prompt / completion / cached tokens, TTFT and duration (seconds), route,
  finish reasons, error.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from collections.abc import Sequence
from typing import TextIO

from telemetry.context import current_request_id
from telemetry.tracing import current_trace_ids

LOG_FORMATS = ("text", "json")
REQUEST_LOGGER = "kdamesh.request"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"

# LogRecord attributes that are not structured fields passed with `extra`
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "request_id", "trace_id", "span_id", "service", "taskName"}


class RequestContextFilter(logging.Filter):
    """Adds request_id, trace_id, span_id and service to every record (never drops one)."""

    def __init__(self, service: str | None = None):
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id()
        if getattr(record, "trace_id", None) is None:
            ids = current_trace_ids()
            record.trace_id, record.span_id = ids if ids is not None else (None, None)
        record.service = self.service
        return True


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "request_id", None) is None:
            record.request_id = "-"
            try:
                return super().format(record)
            finally:
                record.request_id = None
        return super().format(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            "service": getattr(record, "service", None), "request_id": getattr(record, "request_id", None),
            "trace_id": getattr(record, "trace_id", None), "span_id": getattr(record, "span_id", None)}
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps({k: v for k, v in line.items() if v is not None}, default=str, separators=(",", ":"))


def make_formatter(fmt: str) -> logging.Formatter:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    return JsonFormatter() if fmt == "json" else TextFormatter()


def setup_logging(level: str | int = "INFO", fmt: str = "text", service: str | None = None,
                  stream: TextIO | None = None) -> logging.Handler:
    """Configures the root logger (see the module docstring) -> the handler it installed."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    handler.addFilter(RequestContextFilter(service))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler


def log_request(*, request_id: str, tenant: str | None, model: str, endpoint: str, status: int,
                prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0,
                ttft_s: float | None = None, duration_s: float | None = None, route: str | None = None,
                finish_reasons: Sequence[str] = (), error: str | None = None,
                logger: logging.Logger | None = None) -> None:
    """The gateway's access line for one finished API request (see the module docstring)."""
    fields = {"request_id": request_id, "tenant": tenant, "model": model, "endpoint": endpoint, "status": status,
              "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "cached_tokens": cached_tokens,
              "ttft_s": None if ttft_s is None else round(ttft_s, 6),
              "duration_s": None if duration_s is None else round(duration_s, 6), "route": route,
              "finish_reasons": list(finish_reasons) or None, "error": error}
    fields = {k: v for k, v in fields.items() if v is not None}
    ttft = f" ttft={ttft_s * 1e3:.1f}ms" if ttft_s is not None else ""
    took = f" duration={duration_s * 1e3:.1f}ms" if duration_s is not None else ""
    (logger or logging.getLogger(REQUEST_LOGGER)).info(
        "%s %s %d tenant=%s prompt=%d completion=%d cached=%d%s%s%s", endpoint, model, status, tenant or "-",
        prompt_tokens, completion_tokens, cached_tokens, ttft, took, f" error={error}" if error else "",
        extra={"request": fields, "request_id": request_id})
