"""The observability tests' checkpoint and span exporter, shared by every module of the package."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.model.checkpoint import make_checkpoint
from telemetry import tracing
from tests.integration.observability.harness import MODEL


@pytest.fixture(scope="package")
def tiny_k3(tmp_path_factory):
    return make_checkpoint(MODEL, tmp_path_factory.mktemp(MODEL), seed=3)


@pytest.fixture(scope="module")
def spans():
    """The spans every service records, through OpenTelemetry's global provider (installed here once)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if isinstance(provider, SdkTracerProvider):
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider = tracing.setup_tracing("kdamesh-test", "none", span_exporter=exporter)
        assert trace.get_tracer_provider() is provider, "another global tracer provider is installed"
    yield exporter
    exporter.shutdown()  # spans of later tests are dropped
