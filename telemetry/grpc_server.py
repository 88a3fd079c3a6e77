"""The standard gRPC server every kdamesh gRPC service runs (cache, prefill, decode): health and reflection included.

Contract: `start_grpc_server` builds a `grpc.aio` server with the given message-size limit and interceptors, adds
the service (via `add_servicer`), the standard health service — reporting NOT_SERVING for "" and the service name
until the caller sets SERVING — and reflection for the service, health and reflection; binds `address` (port 0: a
free port) and starts it. It raises `OSError` when the address cannot be bound. With a `mesh_token`, every call but
health and reflection must carry it (`mesh_auth.MeshTokenInterceptor`, inside the other interceptors: a rejected call
runs no handler but is traced and counted as UNAUTHENTICATED); without one the server is open (a development mesh on
loopback), and says so in a WARNING when `address` is not a loopback one.

It knows no model and no store: it lives in `telemetry` (which every layer may import) so that the cache service
and the worker services share it without importing each other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from telemetry.mesh_auth import MeshTokenInterceptor

log = logging.getLogger(__name__)
_LOOPBACK = ("127.", "localhost:", "[::1]:")


async def start_grpc_server(address: str, service_name: str, add_servicer: Callable[[grpc.aio.Server], None],
                            max_message_bytes: int, interceptors: Sequence = (),
                            mesh_token: str | None = None) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """-> (started server, bound port, its health servicer)."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes), ("grpc.so_reuseport", 0)]
    auth = [MeshTokenInterceptor(mesh_token)] if mesh_token else []
    if not mesh_token and not address.startswith(_LOOPBACK):
        log.warning("%s on %s accepts calls from anyone: no mesh token (set KDAMESH_MESH_TOKEN)", service_name,
                    address)
    server = grpc.aio.server(options=options, interceptors=[*interceptors, *auth])
    add_servicer(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {service_name} to {address}")
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    return server, port, health_servicer
