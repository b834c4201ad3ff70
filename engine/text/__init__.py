"""Text: the tokenizer, the incremental detokenizer, chat templates, tool-call parsers and the
prompt a request carries (``ChatPrompt``, ``encode_prompt``). The engine's front end and the
router both read prompts through this package; it imports no model code."""
