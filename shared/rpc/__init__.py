"""gRPC plumbing shared by both services: server and channel builders, error mapping,
health, reflection, drain, and the handshake's layout compatibility rules."""

# GRPC_VERBOSITY is set in shared/__init__.py, before anything imports grpc.
