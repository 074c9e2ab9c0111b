"""What llmgw adds to the engines its agent starts, for its gateways to ask.

`PROMPT_TOKENS`: a llama.cpp engine (app/agent/llamacpp_server.py) counts a
chat's prompt as its own chat completion would: the same chat template and
tokenizer, without running the model (docs/design/client-keys.md, "Usage").
The body: the chat request's `messages` and what else shapes its prompt
(`PROMPT_FIELDS`); the answer: `{"count": N}`. An engine an older agent
started answers 404: the gateway then asks a one-token chat instead.
"""

from __future__ import annotations

PROMPT_TOKENS = "/extras/llmgw/chat/prompt_tokens"

# The fields of a chat request its prompt is rendered from.
PROMPT_FIELDS = ("messages", "tools", "tool_choice", "functions", "function_call")
