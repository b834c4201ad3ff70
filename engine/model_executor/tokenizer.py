"""Load the tokenizer (with its chat template) for a model path, offline."""

from __future__ import annotations

import os

from pdserve.engine.model_executor.model_loader import ModelSource, resolve_model_path


def load_tokenizer(model_path: str | None):
    """A transformers fast tokenizer for ``model_path`` (None: the default model).

    GGUF files carry their vocabulary, merges and chat template in their
    metadata, which transformers turns into a fast tokenizer; a Hugging Face
    directory carries tokenizer files. Nothing is fetched from the network.
    """
    return load_tokenizer_from_source(resolve_model_path(model_path))


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
