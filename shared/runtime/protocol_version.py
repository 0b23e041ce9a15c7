"""The wire protocol version every peer announces at handshake (`EngineLayout.protocol_version`).

Peers whose versions differ never pair (shared/rpc/compat.py refuses them, naming the field).
Bump it when the meaning of a field or of the Session protocol changes, and add a row to
docs/protocol-versions.md, the numbered history (tests/unit/rpc/test_rpc_protocol_version.py
keeps the two in step).
"""

from __future__ import annotations

PROTOCOL_VERSION = 6
