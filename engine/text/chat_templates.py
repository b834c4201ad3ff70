"""``--chat-template``: a Jinja template file, or the name of one of the templates below (SGLang's
flag takes a file or a registered name). The chosen template replaces the tokenizer's own."""

from __future__ import annotations

import os

# OpenAI's ChatML, as Qwen and SmolLM2 use it (generation prompt: "<|im_start|>assistant\n")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_INSTRUCT = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
NAMED = {"chatml": CHATML, "llama-3-instruct": LLAMA3_INSTRUCT}


def resolve_chat_template(value: str) -> str:
    """The Jinja text of ``value``: a file's contents, or a named template; ValueError otherwise."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif value in NAMED:
        text = NAMED[value]
    else:
        raise ValueError(f"chat_template {value!r} is neither a file nor a known name ({', '.join(NAMED)})")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template {value!r} is not a valid Jinja template: {e}") from None
    return text


def check_chat_template(value: str | None) -> None:
    if value is not None:
        resolve_chat_template(value)
