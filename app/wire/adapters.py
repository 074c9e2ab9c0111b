"""LoRA adapters in the catalog: which models they name, what that changes
on their base's engines, and the catalog rules only the whole catalog can
check (docs/design/lora-adapters.md). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from app.wire.spec import ModelSpec, Profile, engine_arg_name

# Adapters one replica holds at once unless the base profile sets
# --max-loras itself (vLLM's own default is 1): each slot is GPU memory for
# one adapter's weights (up to --max-lora-rank) kept beside the model.
DEFAULT_MAX_LORAS = 4
# The engine flags a base replica starts with while any adapter names its
# model; vLLM also needs VLLM_ALLOW_RUNTIME_LORA_UPDATING in its
# environment for /v1/load_lora_adapter (the agent sets it, app/agent/engines.py).
ENABLE_LORA = "--enable-lora"


def adapters_of(base: str, models: Mapping[str, ModelSpec]) -> list[str]:
    """The adapters naming `base`, by name."""
    return sorted(n for n, m in models.items()
                  if m.adapter is not None and m.adapter.base == base)


def lora_bases(models: Mapping[str, ModelSpec]) -> frozenset[str]:
    """The models some adapter names."""
    return frozenset(m.adapter.base for m in models.values() if m.adapter is not None)


def max_loras(flags: list[str] | tuple[str, ...]) -> int:
    """The adapters a replica started with `flags` holds at once."""
    for f in flags:
        if engine_arg_name(f) == "max-loras" and "=" in f:
            try:
                return max(1, int(f.split("=", 1)[1]))
            except ValueError:
                return 1
    return DEFAULT_MAX_LORAS if ENABLE_LORA in flags else 0


def engine_flags(prof: Profile, lora: bool) -> list[str]:
    """`prof.engine_flags`, with runtime LoRA loading on when `lora` (an
    adapter names the model; a change restarts its replicas, new first, as
    any change of flags does: vLLM takes --enable-lora at start only)."""
    flags = prof.engine_flags
    if prof.engine != "vllm" or not lora:
        return flags
    names = {engine_arg_name(f) for f in flags}
    extra = [] if "enable-lora" in names else [ENABLE_LORA]
    if "max-loras" not in names:
        extra.append(f"--max-loras={DEFAULT_MAX_LORAS}")
    return flags + extra


def adapter_problem(spec: ModelSpec, models: Mapping[str, ModelSpec]) -> str | None:
    """Why adapter `spec` cannot name its base in catalog `models`, or None."""
    if spec.adapter is None:
        return None
    base = spec.adapter.base
    b = models.get(base)
    if b is None:
        return f"base model {base!r} is not in the catalog"
    if b.adapter is not None:
        return f"base {base!r} is itself an adapter: an adapter names a model with weights"
    if b.external is not None:
        return f"base {base!r} is external: its provider's engines are not ours to load into"
    engines = {p.engine for p in b.profile_list}
    if engines != {"vllm"}:
        return (f"base {base!r} runs on {', '.join(sorted(engines)) or 'no engine'}: "
                "adapters are loaded by vLLM only")
    return None


def base_problem(name: str, spec: ModelSpec | None, models: Mapping[str, ModelSpec]) -> str | None:
    """Why model `name` may not become `spec` (None: be deleted) while
    adapters name it, or None."""
    named = adapters_of(name, models)
    if not named:
        return None
    if spec is None:
        return f"adapters {', '.join(named)} name {name!r} as their base: delete them first"
    trial = dict(models) | {name: spec}
    why = adapter_problem(trial[named[0]], trial)
    if why is not None:
        return f"adapters {', '.join(named)} name {name!r} as their base: {why}"
    return None
