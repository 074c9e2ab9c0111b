"""The model spec: what an operator PUTs at /admin/models/{name}, as stored
under `catalog/models/` (docs/design/catalog.md). Field shapes are
checked here; rules across fields and the catalog are in catalog.py.
"""

from __future__ import annotations

import posixpath
import re
from functools import lru_cache
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from app.wire.names import Engine, check_labels, check_name

# A model hub id: "name" or "org/name", as Hugging Face spells them.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
# Printable, no whitespace: a path is passed to the engine as one argument.
_PATH = re.compile(r"^/[^\x00-\x20\x7f]{1,511}$")


def check_weights(value: str) -> str:
    """A model's weights: a hub id, or an absolute, normalised file path.

    Typed at the boundary: the value becomes an engine's argument, so one that
    starts with "-" (an engine flag in disguise) or walks out of a folder with
    ".." is refused here, before anything runs it. Whether a path lies under
    the configured model roots is checked by the admin API, which has them.
    """
    if value.startswith("/"):
        if not _PATH.match(value) or posixpath.normpath(value) != value:
            raise ValueError(
                f"{value!r} is not an absolute, normalised path (no '..', '//', './' "
                "or spaces)")
        return value
    if not _HUB_ID.match(value) or ".." in value:
        raise ValueError(
            f"{value!r} is neither a hub id ('name' or 'org/name': letters, digits and ._-, "
            "not starting with '-' or '.') nor an absolute path")
    return value



class ReplicaRange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min: int = Field(default=1, ge=0, le=64, description="replicas kept running at all times")
    max: int = Field(default=1, ge=0, le=64, description="most replicas under load")

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaRange:
        if self.max < self.min:
            raise ValueError(f"replicas.max ({self.max}) is below replicas.min ({self.min})")
        return self


# One engine flag per list item, "--name" or "--name=value": never a bare
# value (a flag's argument given as the next item could become the weights or
# another flag's value) and never a short "-x" flag, whose meaning we cannot
# check. Which names are refused depends on the engine (app/wire/catalog.py).
_ENGINE_ARG = re.compile(r"^--[a-z0-9][a-z0-9_-]{0,63}(=[^\x00-\x1f\x7f]{0,1024})?$")


def check_engine_arg(value: str) -> str:
    if not _ENGINE_ARG.match(value):
        raise ValueError(
            f"engine argument {value!r} must be '--name' or '--name=value' (lower-case name, "
            "one list item per flag: '--max-model-len=4096', not '--max-model-len', '4096')")
    return value


def engine_arg_name(arg: str) -> str:
    """The flag's name, spelled with dashes: vLLM reads '--max_model_len' as
    '--max-model-len', so both spellings are compared as one."""
    return arg[2:].split("=", 1)[0].replace("_", "-")


EngineArg = Annotated[str, AfterValidator(check_engine_arg)]


class Profile(BaseModel):
    """One way to run a model: engine, GPUs per replica and engine flags."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="default", max_length=64, description="unique within the model")
    engine: Engine = "vllm"
    gpus: int | None = Field(
        default=None, ge=0, le=16,
        description="GPUs per replica; default 1 for vllm, 0 for llamacpp; vllm with 0 runs "
                    "on nodes whose engine build is cpu (vLLM's CPU build)")
    gpu_memory_gib: float | None = Field(
        default=None, gt=0, le=4096, description="GPU memory a replica needs, GiB per GPU")
    engine_args: list[EngineArg] = Field(
        default_factory=list, max_length=64,
        description="extra engine flags, each '--name' or '--name=value'; flags llmgw sets "
                    "itself (host, port, served model name, keys...) are refused")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1,
        description="vLLM's --gpu-memory-utilization: the share of each GPU's memory it takes")
    max_model_len: int | None = Field(
        default=None, ge=16, le=10_000_000,
        description="vLLM's --max-model-len: the longest context a request may use")
    priority: int = Field(default=0, ge=0, le=1000, description="higher is routed to first")
    weight: float = Field(
        default=1.0, gt=0, le=1000,
        description="share of its priority's requests, relative to other profiles' replicas")
    pool: str = Field(
        default="default", max_length=64, description="the pool its replicas count in")
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="labels a node must have (each label: value) for its replicas to go there")

    @field_validator("name", "pool")
    @classmethod
    def _names(cls, v: str) -> str:
        return check_name(v, "name")

    @field_validator("node_selector")
    @classmethod
    def _selector(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)

    @property
    def gpu_count(self) -> int:
        if self.gpus is not None:
            return self.gpus
        return 1 if self.engine == "vllm" else 0

    @property
    def engine_flags(self) -> list[str]:
        """The engine flags a replica of this profile runs with: its own
        fields as vLLM's flags, then its extra `engine_args`."""
        flags = []
        if self.gpu_memory_utilization is not None:
            flags.append(f"--gpu-memory-utilization={self.gpu_memory_utilization:g}")
        if self.max_model_len is not None:
            flags.append(f"--max-model-len={self.max_model_len}")
        return flags + list(self.engine_args)


class External(BaseModel):
    """A model served by a provider outside the fleet."""

    model_config = ConfigDict(extra="forbid")

    # Checked by app/wire/catalog.py: http(s), never link-local or metadata.
    url: str = Field(..., max_length=2048,
                     description="the provider's address; requests go to URL/v1/...")
    model: str = Field(..., min_length=1, max_length=256, pattern=r"^[^\x00-\x20\x7f]+$",
                       description="the model's name at the provider")
    api_key_file: str | None = Field(
        default=None, max_length=512,
        description="absolute path, on every gateway and under its LLMGW_PROVIDER_KEY_DIR, "
                    "of a regular file holding the provider's key (one line, at most 4 KiB); "
                    "reread every LLMGW_PUBLISH_INTERVAL, so a rotated key is used without a "
                    "restart")
    # As another model's overflow (docs/design/catalog.md, "Spill-over").
    spill_reserve_tokens: int | None = Field(
        default=None, ge=1, le=10_000_000,
        description="as an overflow: the completion tokens a spilled request that names no "
                    "max_tokens (nor max_completion_tokens) reserves from its key's "
                    "external_tokens_per_day until its answer ends; default 4096. This "
                    "model's longest answer makes the budget a hard bound")
    spill_unbudgeted: bool = Field(
        default=False,
        description="as an overflow: keys without external_tokens_per_day spill to it too, "
                    "with no bound on what they spend; default false, such keys' requests "
                    "stay on the fleet")

    @field_validator("api_key_file")
    @classmethod
    def _key_file(cls, v: str | None) -> str | None:
        if v is not None and (not _PATH.match(v) or posixpath.normpath(v) != v):
            raise ValueError(f"{v!r} is not an absolute, normalised path")
        return v


class Adapter(BaseModel):
    """A LoRA adapter of a vLLM model in the catalog, loaded at run time on
    some of the base's replicas (docs/design/lora-adapters.md)."""

    model_config = ConfigDict(extra="forbid")

    base: str = Field(..., max_length=128,
                      description="the catalog model (engine vllm) whose replicas load it")
    weights: str = Field(
        ..., min_length=1, max_length=512,
        description="the adapter's weights: an absolute path under the model roots, on "
                    "every node of its base, or a hub id (vLLM's lora_path; vLLM's load API "
                    "takes no revision)")
    max_replicas: int = Field(
        default=2, ge=1, le=64,
        description="most of the base's replicas it is loaded on at once; it starts on one "
                    "and grows under load")
    load_target: int = Field(
        default=4, ge=1, le=10000,
        description="its requests in flight per replica holding it to grow at")

    @field_validator("base")
    @classmethod
    def _base(cls, v: str) -> str:
        return check_name(v, "base")

    @field_validator("weights")
    @classmethod
    def _adapter_weights(cls, v: str) -> str:
        return check_weights(v)
@lru_cache(maxsize=2)
def _default_range(n: int) -> ReplicaRange:
    """{min: n, max: n}, shared like `_implicit_profile()`'s profile."""
    return ReplicaRange(min=n, max=n)


@lru_cache(maxsize=64)
def _implicit_profile(engine: Engine, gpus: int | None) -> Profile:
    """The flat form's one profile, built once per (engine, gpus) and shared,
    as `profiles` are shared with their spec: a reconcile pass reads it for
    every replica of every model, and validating a new one each time was
    most of a steady pass at 10,000 nodes (docs/design/scale.md)."""
    return Profile(engine=engine, gpus=gpus)


class ModelSpec(BaseModel):
    """What an operator PUTs at /admin/models/{name}.

    Two forms (docs/design/catalog.md): the flat one, `engine` and
    `gpus` beside the weights (one implicit profile named "default", the only
    form before profiles existed, so older specs keep their meaning), or
    `profiles: [...]` without them. An `external` model has neither, nor
    weights, replicas, scaling or quota. A field left out is stored left out
    (None), so an export reads back as it was written. Rules across fields
    are checked by app/wire/catalog.py, which names the field in error.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None, min_length=1, max_length=512,
        description="weights: a hub id ('org/name' or 'name') or an absolute path under the "
                    "gateway's model roots (LLMGW_MODEL_ROOTS); absent for external models")
    revision: str | None = Field(
        default=None, max_length=128,
        description="for a hub id: the branch, tag or commit of the weights (vLLM's --revision)")
    aliases: list[str] = Field(default_factory=list, description="other names clients may use")
    engine: Engine | None = Field(
        default=None, description="flat form: the engine (default vllm)")
    gpus: int | None = Field(
        default=None, ge=0, le=16,
        description="flat form: GPUs per replica (default 1; 0 for llamacpp)")
    profiles: list[Profile] | None = Field(
        default=None, min_length=1, max_length=8,
        description="ways to run the model, instead of the flat engine and gpus; placement "
                    "uses the first")
    replicas: ReplicaRange | None = Field(
        default=None, description="default {min: 1, max: 1}")
    load_target: int | None = Field(
        default=None, ge=1, le=10000, description="requests in flight per replica to scale at")
    idle_timeout: float | None = Field(
        default=None, gt=0, le=30 * 86400,
        description="seconds without requests before scaling down to replicas.min; "
                    "required when replicas.min is 0 and max is not")
    quota: str | None = Field(default=None, max_length=128, description="capacity-quota scope")
    external: External | None = None
    adapter: Adapter | None = Field(
        default=None, description="a LoRA adapter of another catalog model, instead of "
                                  "weights and profiles of its own")
    overflow: str | None = Field(
        default=None, max_length=128,
        description="an external model of the catalog that takes this model's requests when "
                    "every replica is saturated or none is ready within the hold "
                    "(LLMGW_SPILL_HOLD), charged to the key's external_tokens_per_day; a key "
                    "without one does not spill unless the overflow says spill_unbudgeted")

    @field_validator("model")
    @classmethod
    def _weights(cls, v: str | None) -> str | None:
        return check_weights(v) if v is not None else v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str | None) -> str | None:
        if v is not None and (not _REVISION.match(v) or ".." in v):
            raise ValueError(f"revision {v!r} must be letters, digits and ._/-, "
                             "not starting with '-'")
        return v

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        for a in v:
            check_name(a, "alias")
        if len(set(v)) != len(v):
            raise ValueError("aliases repeat")
        return v

    @field_validator("quota")
    @classmethod
    def _quota(cls, v: str | None) -> str | None:
        return check_name(v, "quota scope") if v is not None else v

    @field_validator("overflow")
    @classmethod
    def _overflow(cls, v: str | None) -> str | None:
        return check_name(v, "overflow model") if v is not None else v

    @property
    def profile_list(self) -> list[Profile]:
        """The profiles, the flat form's implicit one included; none if external."""
        if self.external is not None or self.adapter is not None:
            return []
        if self.profiles is not None:
            return self.profiles
        return [_implicit_profile(self.engine or "vllm", self.gpus)]

    @property
    def replica_range(self) -> ReplicaRange:
        if self.external is not None or self.adapter is not None:
            return _default_range(0)
        return self.replicas if self.replicas is not None else _default_range(1)

    def spec_dump(self) -> dict[str, Any]:
        """The spec as given: fields left out stay out (see the class doc)."""
        return self.model_dump(mode="json", exclude_unset=True, exclude_none=True,
                               include=set(ModelSpec.model_fields))


class StoredModel(ModelSpec):
    model_config = ConfigDict(extra="ignore")
    name: str
    created: float = 0.0  # unix time of the first PUT; OpenAI's `created`
