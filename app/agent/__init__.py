"""The node agent (`llmgw agent`): one per node, it reports the node to the
gateways and runs the engines (vLLM, llama.cpp) the leader assigns to it.

It talks to the gateways only over /agent/v1 (a heartbeat, a long poll for
its assignments, its replicas' statuses) and shares with them only app/wire/,
never the control plane (import-linter, pyproject.toml). Engines outlive
the agent: a restarted or upgraded agent adopts the engines it left running
(docs/design/agent.md, "Agent restarts").

- `agent`: the agent: heartbeats, applies assignments, starts and stops engines
- `applied`: which assignments it has applied, kept across its restarts
- `builds`: the vLLM build a node runs, installed and checked
- `codeorigin`: whether an upgrade would change the code this agent runs
- `command`: `llmgw agent`: from its command line to its event loop, re-executed on upgrade
- `config`: what one agent is told at start (`AgentConfig`)
- `engine_site/`: what an engine's PYTHONPATH gets: the engine key guard on its port
- `engines`: each engine's command line, and one running engine process
- `fabric`: the agent's part of the fabric test: stream bytes to another agent, or sink them
- `gateway_client`: how the agent calls the gateways' /agent/v1 API, failing over
- `gpuhealth`: each GPU's health through NVML (XID events, ECC errors, no answer)
- `gpus`: what a node has: its GPUs (NVML, else nvidia-smi), CPUs and memory
- `health`: the probes the agent sends an engine, and what its death means
- `llamacpp_server`: llama-cpp-python's OpenAI server as the agent starts it
- `loads`: the node's engine loads, read once here for every gateway
- `logfiles`: the agent's and its engines' log files: read back, rotated
- `nodeapi`: the agent's own HTTP API: logs, model cache, loads, fabric, upgrade
- `nodeops`: the node-operation parts wired in one place (hardware, node API, logs)
- `running`: what the agent knows of one assigned replica's engine
- `upgrade`: the agent's self-upgrade: install one llmgw wheel, then run it
- `weights`: the node's model cache: what it holds, and removing entries
"""
