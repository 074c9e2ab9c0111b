"""The catalog's rules: what only a whole model spec, or a whole catalog,
can say (an external model with GPUs, min 0 without an idle timeout, an
engine flag llmgw sets itself), each error naming its field.

`ModelSpec` (app/wire/spec.py) checks each field's shape. Both ends apply
these rules: the gateways before every catalog write (the admin API, the
seed from `LLMGW_CATALOG_FILE`; app/control/catalog.py), so nothing invalid
reaches the store, and `llmgw ctl` before it sends a file, so that a bad
file changes nothing (docs/design/catalog.md). Pure.
"""

from __future__ import annotations

import ipaddress
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from app.wire.adapters import adapter_problem
from app.wire.names import Engine, check_name
from app.wire.spec import ModelSpec, Profile, engine_arg_name

# The gateways' provider key folder (app/control/keyfiles.py reads the files).
KEY_DIR_SETTING = "LLMGW_PROVIDER_KEY_DIR"

Loc = tuple[str | int, ...]

# A seed is one transaction, and etcd refuses one of more than 128 operations
# (--max-txn-ops); one goes to `catalog/serial`.
MAX_SEEDED_MODELS = 127

# Flags the agent sets on the engine's command line itself (app/agent/engines.py);
# a second copy from the spec would override ours (argparse keeps the last).
_SET_BY_US: dict[str, frozenset[str]] = {
    "vllm": frozenset({"model", "host", "port", "served-model-name", "api-key", "revision",
                       "tensor-parallel-size", "middleware"}),
    "llamacpp": frozenset({"model", "model-alias", "host", "port", "api-key",
                           "interrupt-requests"}),
}
# A flag named with one of these words carries a secret, and a command line is
# readable by every local user in /proc: keys go in the environment
# (DESIGN invariant 6).
_SECRET_WORDS = frozenset({"key", "keyfile", "token", "secret", "password"})


@dataclass(frozen=True)
class FieldError:
    loc: Loc
    msg: str

    def as_dict(self, prefix: Loc = ()) -> dict[str, Any]:
        """In the shape of the admin API's 422 `errors` (app/api/errors.py)."""
        return {"loc": [*prefix, *self.loc], "msg": self.msg, "type": "value_error"}


class CatalogError(ValueError):
    """A catalog (file) that cannot be seeded, with every reason."""

    def __init__(self, errors: Sequence[FieldError]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(
            f"{'.'.join(str(p) for p in e.loc) or 'catalog'}: {e.msg}" for e in self.errors))


def refused_engine_arg(engine: Engine, arg: str) -> str | None:
    """Why `arg` may not go on `engine`'s command line, or None."""
    name = engine_arg_name(arg)
    ours = _SET_BY_US[engine]
    if name in ours:
        return f"--{name} is set by llmgw itself"
    if _SECRET_WORDS & set(name.split("-")):
        return (f"--{name} would put a secret on the engine's command line, which every "
                "local user can read; llmgw gives engines their keys in the environment")
    # argparse takes an unambiguous prefix for the whole flag ("--serv").
    for full in sorted(ours):
        if full.startswith(name):
            return f"--{name} abbreviates --{full}, which llmgw sets itself"
    return None


# Hosts that answer instance metadata (and with it cloud credentials) from
# inside a VM: an external model's URL must never point a gateway at them.
_METADATA_HOSTS = frozenset({
    "metadata.google.internal", "metadata.goog", "metadata", "instance-data",
    "instance-data.ec2.internal", "metadata.azure.com", "metadata.platformequinix.com",
})
_METADATA_IPS = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200", "192.0.0.192", "168.63.129.16"))


def check_external_url(value: str) -> str:
    """An external provider's address: http(s), no credentials, no query, never
    link-local or a cloud metadata service.

    Not guaranteed: a host name that resolves to such an address is not
    caught here (names are not resolved at validation time).
    """
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises on a port that is not a number in 0-65535
    except ValueError as exc:
        raise ValueError(f"url {value!r} cannot be parsed: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"url {value!r} must be http:// or https://")
    host = (parts.hostname or "").rstrip(".").lower()
    if not host:
        raise ValueError(f"url {value!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("url must not hold credentials: give the key in api_key_file")
    if parts.query or parts.fragment:
        raise ValueError(f"url {value!r} must have no query or fragment")
    if host in _METADATA_HOSTS:
        raise ValueError(f"url host {host!r} is a cloud metadata service")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        for a in (ip, mapped):
            if a is not None and (a in _METADATA_IPS or a.is_link_local
                                  or a.is_multicast or a.is_unspecified):
                raise ValueError(
                    f"url host {host} is link-local, multicast, unspecified or a cloud "
                    "metadata address")
    if parts.path.rstrip("/").endswith("/v1"):
        raise ValueError(
            f"url {value!r} ends in /v1: give the provider's address without it "
            "(requests go to URL/v1/chat/completions and the like)")
    return value


def under_roots(path: str, roots: Sequence[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _check_profile(p: Profile, at: Loc) -> list[FieldError]:
    out: list[FieldError] = []
    # engine vllm with gpus 0 runs on vLLM's CPU build (nodes whose engine
    # build is `cpu`): no GPU memory to ask for.
    if p.engine == "vllm" and p.gpu_count == 0 and p.gpu_memory_gib is not None:
        out.append(FieldError((*at, "gpu_memory_gib"),
                              "engine vllm with gpus 0 runs on vLLM's CPU build: it needs no "
                              "GPU memory"))
    if p.engine == "llamacpp":
        if p.gpu_count != 0:
            out.append(FieldError((*at, "gpus"),
                                  "engine llamacpp runs on CPU nodes: gpus must be 0"))
        if p.gpu_memory_gib is not None:
            out.append(FieldError((*at, "gpu_memory_gib"),
                                  "engine llamacpp runs on CPU nodes: it needs no GPU memory"))
        for f in ("gpu_memory_utilization", "max_model_len"):
            if getattr(p, f) is not None:
                out.append(FieldError((*at, f), f"{f} is a vLLM setting; engine llamacpp "
                                                "takes none"))
    names = {a[2:].split("=", 1)[0].replace("_", "-") for a in p.engine_args}
    for f, flag in (("gpu_memory_utilization", "gpu-memory-utilization"),
                    ("max_model_len", "max-model-len")):
        if getattr(p, f) is not None and flag in names:
            out.append(FieldError((*at, f), f"given twice: as {f} and as --{flag} in "
                                            "engine_args"))
    for j, arg in enumerate(p.engine_args):
        why = refused_engine_arg(p.engine, arg)
        if why is not None:
            out.append(FieldError((*at, "engine_args", j), why))
    return out


_NOT_EXTERNAL = ("model", "revision", "engine", "gpus", "profiles", "replicas", "load_target",
                 "idle_timeout", "quota", "overflow")


def check_spec(spec: ModelSpec, model_roots: Sequence[str],
               key_dir: str | None = None) -> list[FieldError]:
    """Every rule across `spec`'s fields it breaks, each naming its field.

    `key_dir`: the gateways' provider key folder, which an `api_key_file`
    must lie under as written (app/control/keyfiles.py; the file itself is
    checked where it is read); None: not checked (`llmgw ctl`, which does
    not know the gateways' setting)."""
    out: list[FieldError] = []
    if spec.adapter is not None:
        a = spec.adapter
        if spec.external is not None:
            out.append(FieldError(("external",), "an adapter is not external"))
        for f in _NOT_EXTERNAL:
            if getattr(spec, f) is not None:
                out.append(FieldError((f,), "an adapter runs on its base model's replicas: "
                                            f"it takes no {f} (weights go in adapter.weights)"))
        if a.weights.startswith("/"):
            if not under_roots(a.weights, model_roots):
                out.append(FieldError(("adapter", "weights"), (
                    f"{a.weights!r} is not under a model root ({', '.join(model_roots)})")))
        return out
    if spec.external is not None:
        try:
            check_external_url(spec.external.url)
        except ValueError as exc:
            out.append(FieldError(("external", "url"), str(exc)))
        key_file = spec.external.api_key_file
        if key_dir is not None and key_file is not None:
            problem = path_problem(key_file, key_dir)
            if problem is not None:
                out.append(FieldError(("external", "api_key_file"), problem))
        for f in _NOT_EXTERNAL:
            if getattr(spec, f) is not None:
                out.append(FieldError((f,), "an external model is served by its provider, "
                                            f"outside the fleet: it takes no {f}"))
        return out
    if spec.model is None:
        out.append(FieldError(("model",), "required: the weights (a hub id or a path), "
                                          "unless the model is external"))
    elif spec.model.startswith("/"):
        if spec.revision is not None:
            out.append(FieldError(("revision",), "revision applies to a hub id, not to a path"))
        if not under_roots(spec.model, model_roots):
            out.append(FieldError(("model",), (
                f"{spec.model!r} is not under a model root ({', '.join(model_roots)}); "
                "set LLMGW_MODEL_ROOTS on the gateways to allow another folder")))
    if spec.profiles is None:
        out += _check_profile(spec.profile_list[0], ())
    else:
        for f in ("engine", "gpus"):
            if getattr(spec, f) is not None:
                out.append(FieldError((f,), "with profiles, give engine and gpus inside each "
                                            "profile, not beside them"))
        seen: set[str] = set()
        for i, p in enumerate(spec.profiles):
            if p.name in seen:
                out.append(FieldError(("profiles", i, "name"),
                                      f"profile name {p.name!r} repeats"))
            seen.add(p.name)
            out += _check_profile(p, ("profiles", i))
    r = spec.replica_range
    if r.min == 0 and r.max > 0 and spec.idle_timeout is None:
        out.append(FieldError(("idle_timeout",), (
            "replicas.min 0 needs an idle_timeout: replicas started on demand would "
            "otherwise never stop (set replicas.max 0 to keep the model without replicas)")))
    return out


def check_catalog(models: Mapping[str, ModelSpec], model_roots: Sequence[str],
                  key_dir: str | None = None) -> list[FieldError]:
    """Each model's rules, and names and aliases unique across the catalog."""
    out: list[FieldError] = []
    if len(models) > MAX_SEEDED_MODELS:
        out.append(FieldError(("models",), f"{len(models)} models: a seed is one transaction "
                                           f"and takes at most {MAX_SEEDED_MODELS}"))
    for name in sorted(models):
        try:
            check_name(name, "model name")
        except ValueError as exc:
            out.append(FieldError(("models", name), str(exc)))
        out += [FieldError(("models", name, *e.loc), e.msg)
                for e in check_spec(models[name], model_roots, key_dir)]
    for name in sorted(models):
        why = adapter_problem(models[name], models)
        if why is not None:
            out.append(FieldError(("models", name, "adapter", "base"), why))
        problem = overflow_problem(name, models[name], models)
        if problem is not None:
            out.append(FieldError(("models", name, "overflow"), problem))
    taken = {n: n for n in models}
    for name in sorted(models):
        for i, alias in enumerate(models[name].aliases):
            owner = taken.setdefault(alias, name)
            if owner != name:
                out.append(FieldError(("models", name, "aliases", i),
                                      f"{alias!r} already names model {owner!r}"))
    return out


def overflow_problem(name: str, spec: ModelSpec,
                     models: Mapping[str, ModelSpec]) -> str | None:
    """Why `spec`'s overflow (docs/design/catalog.md, "Spill-over")
    cannot be, given the rest of the catalog: it must name an external model."""
    target = spec.overflow
    if target is None or spec.external is not None:
        return None  # an external model's overflow is refused by check_spec
    if target == name:
        return "a model cannot overflow to itself"
    other = models.get(target)
    if other is None:
        return f"{target!r} is not in the catalog: add the external model first"
    if other.external is None:
        return f"{target!r} is not an external model: an overflow goes to a provider"
    return None


def overflowing_to(target: str, models: Mapping[str, ModelSpec]) -> list[str]:
    """The models whose overflow is `target`: while any is, `target` stays
    external (deleting it, or making it local, is refused)."""
    return sorted(n for n, m in models.items() if m.overflow == target and n != target)


def parse_catalog(data: object, model_roots: Sequence[str],
                  key_dir: str | None = None) -> dict[str, ModelSpec]:
    """`{"models": {name: spec, ...}}` (export's form) as specs; CatalogError
    naming every field in error otherwise."""
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise CatalogError([FieldError((), "expected a mapping {models: {name: spec, ...}}")])
    extra = sorted(str(k) for k in data if k != "models")
    if extra:
        raise CatalogError([FieldError((k,), "unknown key: only 'models'") for k in extra])
    errors: list[FieldError] = []
    specs: dict[str, ModelSpec] = {}
    for name, raw in data["models"].items():
        try:
            specs[str(name)] = ModelSpec.model_validate(raw or {})
        except ValidationError as exc:
            errors += [FieldError(("models", str(name), *e["loc"]), e["msg"])
                       for e in exc.errors()]
    errors += check_catalog(specs, model_roots, key_dir)
    if errors:
        raise CatalogError(errors)
    return specs


def under(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def path_problem(path: str, key_dir: str) -> str | None:
    """Why `path`, as written, may not be a key file (pure: no filesystem)."""
    if not key_dir:
        return ("no provider key folder is configured on the gateways "
                f"({KEY_DIR_SETTING} is empty): external models cannot take a key file")
    if not under(posixpath.normpath(path), key_dir):
        return f"must lie under the provider key folder {key_dir} ({KEY_DIR_SETTING})"
    return None
