"""The base of every group of settings: read from the environment with the
prefix `LLMGW_`, unknown variables ignored. A group can be built alone (a
test, a tool that needs only its part); the gateway builds them all at once
as `app.gateway.settings.Settings`.

No float setting takes nan or an infinity, bounded or not: a timeout of nan
compares false with everything (never expires, or always), inf passes a
`gt=0` bound. Refused before any bound, in one message naming the variable.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# allow_inf_nan: a float held anywhere (in a list, say) is refused too.
CONFIG = SettingsConfigDict(env_prefix="LLMGW_", extra="ignore", allow_inf_nan=False)


def finite(value: Any, variable: str) -> Any:
    """`value` unless it reads as a float that is not finite (ValueError)."""
    if isinstance(value, str | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            return value  # not a number at all: the field's own check says so
        if not math.isfinite(number):
            raise ValueError(f"{variable} must be a finite number, not {value!r}")
    return value


class Group(BaseSettings):
    model_config = CONFIG

    @field_validator("*", mode="before")
    @classmethod
    def _finite(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None or field.annotation not in (float, float | None):
            return value
        return finite(value, f"LLMGW_{(info.field_name or '').upper()}")
