"""Service settings for prefill-svc and decode-svc: flags, then env `HYBRID_PD_<FLAG>`, then defaults.

values.py    the flags' value types (text -> value, or ValueError)
flags.py     the flag table: every flag, its type, help, default and service
parser.py    each service's argparse parser, built from the table
settings.py  ServiceSettings and how flags, environment and defaults resolve into it
"""

from shared.config.flags import (
    DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS,
    DEFAULT_MAX_BATCHED_TOKENS,
    DEFAULT_READ_TIMEOUT_SECONDS,
    ENV_PREFIX,
    FLAGS,
    Flag,
    Role,
)
from shared.config.parser import build_parser
from shared.config.settings import ServiceSettings, SettingsError, TlsSettings, parse_settings
from shared.config.values import boolean, existing_file, host_port, split_advertised

__all__ = [
    "DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS",
    "DEFAULT_MAX_BATCHED_TOKENS",
    "DEFAULT_READ_TIMEOUT_SECONDS",
    "ENV_PREFIX",
    "FLAGS",
    "Flag",
    "Role",
    "ServiceSettings",
    "SettingsError",
    "TlsSettings",
    "boolean",
    "build_parser",
    "existing_file",
    "host_port",
    "parse_settings",
    "split_advertised",
]
