from __future__ import annotations

import os

import pytest

from shared.transport.nixl_env import NIXL_ENV_DEFAULTS, apply_env_defaults, load_nixl

pytestmark = pytest.mark.timeout(30)


def test_defaults_fill_only_what_the_user_did_not_set() -> None:
    env = {"UCX_MM_ERROR_HANDLING": "n"}
    applied = apply_env_defaults(env)
    assert env["UCX_MM_ERROR_HANDLING"] == "n"  # the user's choice wins
    assert env["NIXL_LOG_LEVEL"] == "WARN"
    assert applied == {"NIXL_LOG_LEVEL": "WARN"}
    assert apply_env_defaults(env) == {}


def test_load_nixl_sets_the_environment_and_exposes_the_api() -> None:
    api = load_nixl()
    assert load_nixl() is api
    for key in NIXL_ENV_DEFAULTS:
        assert key in os.environ
    assert callable(api.nixl_agent) and callable(api.nixl_agent_config)
    assert api.error_named("nixlRemoteDisconnectError") in api.errors
    with pytest.raises(KeyError):
        api.error_named("noSuchError")
