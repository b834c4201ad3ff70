"""Structured output: grammars (JSON schema, regex, EBNF) compiled with xgrammar, one matcher per request."""
