"""Client channels: same message limits as the servers, keepalive, and a retry policy for the
unary calls that are safe to retry."""

from __future__ import annotations

import json

import grpc

from shared.config import TlsSettings
from shared.rpc.server import MAX_MESSAGE_BYTES
from shared.rpc.tls import channel_credentials

HANDSHAKE_TIMEOUT_SECONDS = 10.0

SERVICE_CONFIG = {
    "methodConfig": [
        {
            # Idempotent unary calls: retried on UNAVAILABLE (peer restarting or draining).
            "name": [
                {"service": "hybridpd.v1.PrefillService", "method": "Handshake"},
                {"service": "hybridpd.v1.DecodeService", "method": "GetLayout"},
            ],
            "timeout": f"{HANDSHAKE_TIMEOUT_SECONDS:g}s",
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}

CHANNEL_OPTIONS: list[tuple[str, str | int]] = [
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


def build_channel(target: str, tls: TlsSettings | None = None, server_name: str | None = None) -> grpc.aio.Channel:
    """One channel per peer per process; create it inside the running loop and close it on shutdown.

    `server_name`: the name the server's certificate must carry when `target` is an address found
    by resolving that name (peer discovery), so TLS still checks the name, not the address."""
    creds = channel_credentials(tls) if tls is not None else None
    if creds is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    options = list(CHANNEL_OPTIONS)
    if server_name is not None:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(target, creds, options=options)
