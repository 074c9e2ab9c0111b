"""What the control side hands the router (app/gateway/publish.py), as plain
values: a replica's endpoint, a catalog entry, a client key's grant and its
limits."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits for all gateways together; None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    # Tokens a day served by models' overflows (spill-over, app/router/spill.py).
    external_tokens_per_day: int | None = None


NO_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Endpoint:
    replica_id: str
    url: str
    # The engine key this replica demands (an external model's: the
    # provider's key); never logged.
    key: str = field(repr=False)
    # The model name to send upstream instead of the catalog name: an
    # external model's name at its provider. Empty: the catalog name.
    upstream_model: str = ""
    # From the replica's profile: a higher priority is chosen first; weights
    # share a priority's requests (see choice.py).
    priority: int = 0
    weight: float = 1.0
    # The replica's engine ("vllm", "llamacpp"; empty for an external
    # provider): llama.cpp's streams carry no usage, so the router counts
    # them (app/router/usage/prompt_count.py).
    engine: str = ""
    # A LoRA adapter's name, on an endpoint that serves it from its base's
    # replica (upstream_model is that name too): its requests in flight are
    # counted apart, what sizes its set of replicas.
    adapter: str = ""
    # An external model's terms as another's overflow (its spec's
    # `external`, app/router/spill.py): the completion tokens a spill naming
    # no max_tokens reserves (0: estimates.DEFAULT_RESERVE), and whether keys
    # without external_tokens_per_day may spill to it, unbounded.
    spill_reserve: int = 0
    spill_unbudgeted: bool = False


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    aliases: tuple[str, ...] = ()
    created: int = 0
    parent: str = ""  # a LoRA adapter's base model, as vLLM lists it


@dataclass(frozen=True, slots=True)
class KeyGrant:
    """What a client key may do. `models` empty means every model.

    `limits` are the key's, for all gateways together; each gateway admits
    up to its claim on them (app/router/usage/limits.py); `gateways`, the live
    gateways, gives equal shares until the claims loop runs. `expires`: a
    Unix time, None for never."""

    id: str
    name: str
    models: frozenset[str] = frozenset()
    limits: Limits = NO_LIMITS
    gateways: int = 1
    expires: float | None = None

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models
