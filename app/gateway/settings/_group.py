"""The base of every group of settings: read from the environment with the
prefix `LLMGW_`, unknown variables ignored. A group can be built alone (a
test, a tool that needs only its part); the gateway builds them all at once
as `app.gateway.settings.Settings`."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

CONFIG = SettingsConfigDict(env_prefix="LLMGW_", extra="ignore")


class Group(BaseSettings):
    model_config = CONFIG
