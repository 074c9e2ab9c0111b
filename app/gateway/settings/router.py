"""The router's settings: the limits on one /v1 request's life (connect,
first byte, idle stream, the whole request), which replica it goes to
(cooldown, prompt affinity), scale from zero's held requests, and client
keys' usage, limit shares and prompt counts. Read by app/router and the
gateway that wires it (app/router/timeouts.py holds them as plain values)."""

from __future__ import annotations

from pydantic import Field

from app.gateway.settings._group import Group


class RouterSettings(Group):
    # --- router -------------------------------------------------------------------
    # The limits on one /v1 request's life (docs/design/routing.md).
    # Seconds to wait for an engine to accept a connection before trying
    # another replica. Longer: a dead node's replicas cost each request that
    # long; shorter: a busy engine's accept queue is taken for a dead one.
    connect_timeout: float = Field(5.0, gt=0)
    # One deadline per request, across all its attempts, until the last byte
    # of the answer (a plain answer comes whole only once generated, so this
    # bounds the longest plain generation). Shorter cuts long generations;
    # longer lets a wedged engine hold a client that long.
    request_timeout: float = Field(600.0, gt=0)
    # A stream's first body byte must come within this long of the request
    # reaching the engine: queueing, then the prefill of the whole prompt (a
    # 100k-token prompt on a busy GPU takes minutes). Longer: an engine
    # that hangs holds its clients longer before their 504; shorter: long
    # prompts fail under load. Not retried: the engine may still be working.
    first_byte_timeout: float = Field(300.0, gt=0)
    # After its first byte, a stream that sends nothing for this long ends
    # with an error event. Engines send a token every few tens of ms; vLLM
    # preempting a request under memory pressure pauses it for seconds.
    # Shorter cuts those pauses; longer holds a dead stream open longer.
    # The same limit drops a client that takes nothing for this long (its
    # socket full): it would hold the engine's connection, the replica's
    # in-flight count and its key's concurrency until the request timeout.
    stream_idle_timeout: float = Field(60.0, gt=0)
    # Seconds a replica that failed a request (refused, 502/503, broke off,
    # stalled) is passed over while another replica of its model is left.
    # Longer spares clients a dead replica until the agent reports it (a few
    # seconds); shorter puts a recovered one back to work sooner. 0: off.
    replica_cooldown: float = Field(5.0, ge=0)
    # Prompt affinity: requests of one conversation (X-Session-Id,
    # prompt_cache_key, or the same opening messages) go to one replica while
    # its load stays within 1.25x the mean, so the engine reuses its prefix
    # cache. Off: power of two choices alone (measured in bench/affinity.py).
    router_affinity: bool = True
    # Scale from zero: a request for a model whose replica is on its way
    # (loading, or a min-0 model stopped while idle) is held this long, then
    # answered 503. Longer covers slower model loads (a 70B model can take
    # minutes); it must stay under request_timeout.
    cold_start_timeout: float = Field(300.0, gt=0)
    # Requests one gateway holds per starting model; more answer 503 with
    # Retry-After at once. Each held request is one open connection.
    cold_start_max_held: int = Field(64, ge=0)
    # Spill-over: a request for a model with an overflow (docs/design/catalog.md, "Spill-over")
    # waits this long for a replica on its way, then goes to the
    # overflow instead. Longer spends less of the keys' external budgets on
    # cold starts, at that much more latency for the requests that spill.
    spill_hold: float = Field(10.0, gt=0)

    # --- client keys (docs/design/client-keys.md) -------------------------
    # Seconds between this gateway's writes of client key usage (one
    # transaction per 64 keys in use, never one per request). Longer: fewer
    # store writes; GET /admin/keys/{id}/usage lags by up to this long, and a
    # crashed gateway loses up to this long of counts (a clean stop loses none).
    key_usage_interval: float = Field(5.0, gt=0)
    # Seconds between passes of the loop that moves each gateway's claims on
    # client keys' limits toward where their requests arrive (app/gateway/key_shares.py;
    # it also runs at once on a refusal below a key's limit). Its record is
    # written at most this often while only its load changes. Shorter: claims
    # follow a client sooner, for more store writes from busy gateways.
    key_share_interval: float = Field(0.5, gt=0)
    # A llama.cpp stream's prompt is counted by its engine after the stream
    # (app/router/usage/prompt_count.py): at most this many counts at once per
    # gateway, each waiting its turn behind the engine's requests for up to
    # the timeout, then estimated instead. More: each count waits less
    # behind the others, while a chat's count may cost its engine a prefill;
    # a longer timeout estimates fewer prompts of a busy engine.
    prompt_count_concurrency: int = Field(2, ge=1)
    prompt_count_timeout: float = Field(120.0, gt=0)
