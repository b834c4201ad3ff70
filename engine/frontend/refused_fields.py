"""Request fields that pdserve accepts in its schema but does not implement: refused, never ignored.

The request Structs (``request_schemas.py``) forbid unknown fields, so a typo is a 400
naming it. Fields of OpenAI's or SGLang's schema that pdserve has no feature for
stay in the Structs (SGLang's router sends some of them with their default
value on every request), and this table lists, per body, the values such a
field may carry: its absent or default values, which ask for nothing. Any
other value is a 400 naming the field (``code: "unsupported"``), so a client
never gets the base model when it asked for a LoRA adapter, or plain output
when it asked for hidden states.

The fields of structured output and tools (``response_format``, ``tools``,
``regex``, ...) and LoRA's ``lora_path`` are checked where they are implemented, not here.

Accepted with any value, as they ask for nothing pdserve leaves undone:
``user`` (OpenAI's end-user id, for the caller's abuse monitoring), ``no_logs``
(pdserve never logs request contents), ``separate_reasoning`` and
``stream_reasoning`` (obeyed under ``--reasoning-parser``; without one there is
nothing to separate, as in SGLang), ``bootstrap_pair_key`` (a PD
gateway's pairing hint; pdserve pairs by ``bootstrap_room``).
"""

from __future__ import annotations

from typing import Any

ABSENT = (None,)
FALSE = (None, False)  # a flag whose SGLang default is off
TRUE = (None, True)  # a flag whose SGLang default is on

# field -> the values that ask for nothing (anything else is refused)
SAMPLING_PARAMS: dict[str, tuple] = {
    "custom_params": ABSENT,  # arguments of a custom logit processor
    "logit_bias": (None, {}),
    "stream_interval": (None, 1),  # every token is streamed as it comes
    # transformers' fast tokenizers have no such switch; SGLang's default is True
    "spaces_between_special_tokens": TRUE,
}

# /generate's body (its sampling_params: SAMPLING_PARAMS)
GENERATE: dict[str, tuple] = {
    "lora_id": ABSENT,  # SGLang's internal id; adapters are named by lora_path (lora_fields.py)
    "custom_logit_processor": ABSENT,
    "session_params": ABSENT,
    "extra_key": ABSENT,  # a prefix-cache namespace
    "custom_labels": ABSENT,
    "conversation_id": ABSENT,
    "modalities": (None, [], ["text"]),
    "image_data": ABSENT,
    "video_data": ABSENT,
    "audio_data": ABSENT,
    "input_embeds": ABSENT,
    "token_ids_logprob": ABSENT,
    "return_hidden_states": FALSE,
    "return_bytes": FALSE,
    "return_entropy": FALSE,
    "background": FALSE,
    "log_metrics": TRUE,  # every request is counted in /metrics
}

# both OpenAI endpoints
OPENAI: dict[str, tuple] = {
    "session_params": ABSENT,
    "custom_logit_processor": ABSENT,
    "custom_params": ABSENT,
    "extra_key": ABSENT,
    "return_hidden_states": FALSE,
    "spaces_between_special_tokens": TRUE,
}

COMPLETIONS: dict[str, tuple] = {**OPENAI, "suffix": ABSENT}

CHAT: dict[str, tuple] = {
    **OPENAI,
    "modalities": (None, [], ["text"]),
    "store": FALSE,
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "reasoning_effort": ABSENT,
    "web_search_options": ABSENT,
}

STREAM_OPTIONS: dict[str, tuple] = {"continuous_usage_stats": FALSE}


class UnsupportedField(ValueError):
    """A field set to a value pdserve does not implement; ``param`` is its path in the body."""

    def __init__(self, param: str, value: Any):
        super().__init__(f"`{param}` is not supported by pdserve (got {value!r})")
        self.param = param


def _same(value: Any, allowed: Any) -> bool:
    # True == 1 in Python: a flag's True must not pass for stream_interval's 1, nor 1 for True
    return type(value) is type(allowed) and value == allowed


def check(obj: Any, table: dict[str, tuple], prefix: str = "") -> None:
    """Raise ``UnsupportedField`` for the first field of ``obj`` whose value ``table`` does not allow."""
    for name, allowed in table.items():
        value = getattr(obj, name)
        if not any(_same(value, a) for a in allowed):
            raise UnsupportedField(prefix + name, value)
