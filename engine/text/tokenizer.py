"""Load the tokenizer (with its chat template) for a model path, offline."""

from __future__ import annotations

import os

from pdserve.engine.text.chat_templates import resolve_chat_template
from pdserve.engine.model_source import ModelSource, resolve_model_path


def load_tokenizer(model_path: str | None, tokenizer_path: str | None = None, chat_template: str | None = None):
    """A transformers fast tokenizer for ``model_path`` (None: the default model).

    GGUF files carry their vocabulary, merges and chat template in their
    metadata, which transformers turns into a fast tokenizer; a Hugging Face
    directory carries tokenizer files. Nothing is fetched from the network.
    ``tokenizer_path`` (``--tokenizer-path``): another GGUF file or directory to take the
    tokenizer from (a directory of tokenizer files alone will do); ``chat_template``
    (``--chat-template``): a template file or name replacing the tokenizer's own.
    """
    if tokenizer_path is None:
        source = resolve_model_path(model_path)
    elif os.path.isdir(tokenizer_path) and not os.path.isfile(os.path.join(tokenizer_path, "config.json")) \
            and not any(f.endswith(".gguf") for f in os.listdir(tokenizer_path)):
        source = ModelSource(os.path.abspath(tokenizer_path), "hf")  # tokenizer files without a model
    else:
        source = resolve_model_path(tokenizer_path)
    tokenizer = load_tokenizer_from_source(source)
    if chat_template is not None:
        tokenizer.chat_template = resolve_chat_template(chat_template)
    return tokenizer


def load_tokenizer_from_source(source: ModelSource):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if source.format == "gguf":
        # PreTrainedTokenizerFast directly, not AutoTokenizer: the latter also builds a model
        # config from the GGUF with a slow reader, seconds that the tokenizer does not need
        return PreTrainedTokenizerFast.from_pretrained(
            source.directory, gguf_file=os.path.basename(source.path), local_files_only=True
        )
    try:
        return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"model_path {source.path!r} has no loadable tokenizer files: {exc}") from exc
