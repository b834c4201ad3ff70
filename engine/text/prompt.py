"""A request's prompt and its token ids: text, token ids, or chat messages for the model's template.

The engine's front end and the router's KV-aware policy encode prompts the same way, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChatPrompt:
    """Messages to render with the model's chat template."""

    messages: list[dict[str, Any]]
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def encode_prompt(tokenizer, prompt: str | list[int] | ChatPrompt) -> list[int]:
    """Token ids of a prompt: text as the tokenizer encodes it, chat through the model's template."""
    if isinstance(prompt, list):
        return list(prompt)
    if isinstance(prompt, ChatPrompt):
        text = tokenizer.apply_chat_template(
            prompt.messages,
            tokenize=False,
            add_generation_prompt=not prompt.continue_final_message,
            continue_final_message=prompt.continue_final_message,
            **prompt.chat_template_kwargs,
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def prompt_chars(prompt: str | list[int] | ChatPrompt) -> int:
    """Characters a prompt gives the tokenizer, bounded cheaply before tokenizing: a text's length,
    a chat's messages as JSON (their text and then some), 0 for token ids."""
    if isinstance(prompt, list):
        return 0
    if isinstance(prompt, ChatPrompt):
        import json

        return len(json.dumps(prompt.messages, default=str))
    return len(prompt)
