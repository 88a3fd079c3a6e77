"""cache_service imports only protos, the standard library, grpc, redis, xxhash, prometheus_client and telemetry (with
OpenTelemetry; telemetry itself imports no kdamesh package) (DESIGN.md: it stores bytes and knows no model)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ALLOWED = {"cache_service", "protos", "grpc", "grpc_health", "grpc_reflection", "redis", "xxhash", "prometheus_client",
           "google", "telemetry", "opentelemetry"} | set(sys.stdlib_module_names)


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_cache_service_imports_stay_in_bounds():
    for path in sorted((ROOT / "cache_service").glob("*.py")):
        extra = imported_roots(path) - ALLOWED
        assert not extra, f"{path.name} imports {sorted(extra)}"


def test_importing_the_service_pulls_no_torch_or_engine():
    code = ("import sys, cache_service.client, cache_service.server, cache_service.redis_store; "
            "bad = {'torch', 'engine', 'kernels'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
