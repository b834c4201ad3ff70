"""Attention backends: the paged-KV attention of one forward batch (torch, flashinfer)."""
