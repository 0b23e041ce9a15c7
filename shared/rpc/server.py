"""Building a grpc.aio server the same way for both services (grpc-conventions 1.1, 1.4)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from shared.config import TlsSettings
from shared.errors import Unavailable
from shared.rpc.interceptors import ErrorToStatusInterceptor
from shared.rpc.tls import server_credentials

MAX_MESSAGE_BYTES = 64 << 20  # NIXL agent metadata and large manifests exceed the 4 MiB default

SERVER_OPTIONS: list[tuple[str, int]] = [
    # Linux default is 1: a second server on the same port would silently share it.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_concurrent_streams", 256),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Must not exceed the clients' keepalive interval, or they get GOAWAY "too_many_pings".
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
]


def build_server(interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A server whose handlers' domain errors become statuses (outermost interceptor)."""
    return grpc.aio.server(interceptors=[ErrorToStatusInterceptor(), *interceptors], options=SERVER_OPTIONS)


def listen(server: grpc.aio.Server, address: str, tls: TlsSettings) -> int:
    """Bind `address` (HOST:PORT, port 0 = any free port); return the bound port."""
    creds = server_credentials(tls)
    try:
        port = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
    except RuntimeError as e:  # grpc raises RuntimeError("Failed to bind to address ...")
        raise Unavailable(f"cannot listen on {address}: {e} (port in use, or host not local?)", field="port") from e
    if port == 0:
        raise Unavailable(f"cannot listen on {address} (port in use, or host not local?)", field="port")
    return int(port)


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """grpcurl can list, describe and call everything without proto files."""
    names = (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
