"""gRPC plumbing shared by both services: server and channel builders, error mapping,
health, reflection, drain, and the handshake's layout compatibility rules."""

import os

# grpc-core logs INFO lines (e.g. on every GOAWAY) unless told otherwise; must be set before
# grpc is imported. setdefault: a user's own setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
