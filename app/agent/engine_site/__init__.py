"""Modules the agent puts on an engine's PYTHONPATH (docs/design/security.md, "The engine's port").
This folder is that path entry, so everything in it
must import with the standard library alone: engines run in environments
of their own (a vLLM build's venv) that do not have llmgw installed.

- `llmgw_engine_guard`: the engine key on every path of a vLLM engine's port
"""
