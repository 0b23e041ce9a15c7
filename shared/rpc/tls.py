"""Credentials from the --tls-* files: plaintext when none are given (local use)."""

from __future__ import annotations

import grpc

from shared.config import TlsSettings


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials | None:
    """TLS with the service's cert/key; with a CA, clients must present a certificate it signed."""
    if tls.cert is None or tls.key is None:
        return None
    ca = tls.ca.read_bytes() if tls.ca is not None else None
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials | None:
    """Trust the CA (or the system roots) and present cert/key when given (mutual TLS)."""
    if not tls.enabled:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes() if tls.ca is not None else None,
        private_key=tls.key.read_bytes() if tls.key is not None else None,
        certificate_chain=tls.cert.read_bytes() if tls.cert is not None else None,
    )
