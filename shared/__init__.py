"""hybrid-pd's library, shared by the prefill and decode services, the CLI and the benchmarks."""

import os

# grpc-core logs INFO lines (e.g. on every GOAWAY) unless told otherwise; this must be set
# before grpc is first imported, and every entry point imports this package first.
# setdefault: a user's own setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
