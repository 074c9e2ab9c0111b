"""The all-in-one mode's agent: the one `llmgw serve` runs in its own
process (docs/architecture.md, "Processes"). Read by app/gateway/assembly.py when it
starts that agent. `llmgw agent` on a node has its own settings
(app/agent/config.py and its CLI), which read LLMGW_ENGINE_START_TIMEOUT and
LLMGW_VLLM_BIN too."""

from __future__ import annotations

from pydantic import Field

from app.gateway.settings._group import Group


class LocalAgentSettings(Group):
    # Run an agent inside `llmgw serve` (the all-in-one mode). Default: on
    # with the embedded store, off with etcd.
    local_agent: bool | None = None
    # Name of the in-process agent's node.
    local_node: str = ""
    # GPUs the in-process agent declares; unset: discovered with nvidia-smi.
    local_gpus: int | None = None
    # Seconds an engine may stay `starting` before its agent stops it and
    # counts a death (3 in 10 min leave it failed). Also read by `llmgw
    # agent`. Generous: large weights download and load slowly; shorter
    # kills slow but healthy loads, longer holds the GPUs of a hung one.
    engine_start_timeout: float = Field(1800.0, gt=0)
    # All-in-one mode: stop the in-process agent's engines when `llmgw serve`
    # stops. Off by default: they keep running and the next `llmgw serve` on
    # the same data_dir adopts them, so a restart reloads no model. On: a
    # stop frees the GPUs, and the next start loads every model again.
    stop_engines_on_exit: bool = False
    # The operator's own vLLM executable: used as it is, never installed over.
    # Empty: `vllm` on PATH, and only on nodes with GPUs.
    vllm_bin: str = ""
