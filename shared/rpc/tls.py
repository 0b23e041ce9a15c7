"""Credentials from the --tls-* files: plaintext when none are given (local use)."""

from __future__ import annotations

import grpc

from shared.config import TlsSettings


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials | None:
    """TLS with the service's cert/key; with a client CA, clients must present a certificate it
    signed (the CA clients trust, `tls.ca`, plays no part here)."""
    if tls.cert is None or tls.key is None:
        return None
    client_ca = tls.client_ca.read_bytes() if tls.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
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
