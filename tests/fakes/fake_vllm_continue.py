"""How the vLLM stand-in (fake_vllm.py) continues a message it was given:
the fields a gateway sends to resume a stream whose engine died
(docs/design/stream-continuation.md).

Checked against vLLM's source (search tool, vllm-project/vllm,
``vllm/entrypoints/openai/protocol.py`` ChatCompletionRequest):
``add_generation_prompt`` defaults to true, ``continue_final_message`` to
false ("the chat will be formatted so that the final message in the chat is
open-ended, without any EOS tokens. The model will continue this message
rather than starting a new one"), and a request setting both is refused:
400 "Cannot set both `continue_final_message` and `add_generation_prompt` to
True." The text of the continued message is not sent again (only with
``echo``), so a stream resumes with the next token.

The stand-in's answers are known sequences of words (``fake-vllm MODEL echo:
ASKED``): given the first words of its answer as the final assistant
message, it streams the words after them, so a client of a resumed stream
can check it saw the whole sequence exactly once. Its prompt count is that
of vLLM's in spirit: an open assistant message costs its words and no
framing token, as the generation prompt of the first request cost none, so
the resumed prompt is the first one plus the words already streamed.
"""

from __future__ import annotations

from typing import Any

BOTH = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
NOT_ASSISTANT = ("continue_final_message is set but the final message is not an assistant "
                 "message.")


def continued(body: dict[str, Any], messages: list[Any]) -> tuple[str | None, str | None]:
    """(the final assistant message's text to continue, or None if the chat
    is not a continuation; the error to answer 400 with, or None)."""
    cont = body.get("continue_final_message") is True
    if cont and body.get("add_generation_prompt", True):
        return None, BOTH
    if not cont:
        return None, None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return None, NOT_ASSISTANT
    content = last.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return (content if isinstance(content, str) else ""), None


def words_after(full: list[str], given: str) -> list[str]:
    """The words of `full` after `given`, when `given` is made of its first
    words; else all of them (an answer not its own is not continued)."""
    start = given.split()
    return full[len(start):] if full[:len(start)] == start else full


def completion_split(prompt: str, model: str) -> tuple[str, str]:
    """A text completion's prompt as (what was asked, the start of the
    stand-in's own answer to it that the prompt ends with): a prompt that
    ends with the first words of its answer continues that answer."""
    marker = f"fake-vllm {model} echo:"
    at = prompt.find(marker)
    while at >= 0:
        head, given = prompt[:at], prompt[at:]
        if f"{marker} {head}".split()[:len(given.split())] == given.split():
            return head, given
        at = prompt.find(marker, at + 1)
    return prompt, ""
