"""Speculative decoding: proposers that guess the next tokens, checked by one verify step."""
