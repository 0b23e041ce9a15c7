"""NIXL data plane: one agent per rank, prepared READs, one completion poller per process."""

from shared.cache.memory_place import MemoryPlace
from shared.transport.agent import PreppedList, RankAgent, Xfer, agent_name, new_incarnation
from shared.transport.errors import PeerAlreadyKnown, TransferFailed, TransferTimedOut, TransportError
from shared.transport.memory import nixl_descs
from shared.transport.nixl_env import NIXL_ENV_DEFAULTS, NixlApi, apply_env_defaults, load_nixl
from shared.transport.notifications import NotificationRouter
from shared.transport.poller import CompletionPoller, PollerStats, ReadResult

__all__ = [
    "NIXL_ENV_DEFAULTS",
    "CompletionPoller",
    "MemoryPlace",
    "NixlApi",
    "NotificationRouter",
    "PeerAlreadyKnown",
    "PollerStats",
    "PreppedList",
    "RankAgent",
    "ReadResult",
    "TransferFailed",
    "TransferTimedOut",
    "TransportError",
    "Xfer",
    "agent_name",
    "apply_env_defaults",
    "load_nixl",
    "new_incarnation",
    "nixl_descs",
]
