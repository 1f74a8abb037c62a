"""Paged causal attention: public entry points (GPU kernels plug in behind the same signatures)."""
from .reference import paged_attention_ref, write_kv_ref

paged_attention = paged_attention_ref
write_kv = write_kv_ref

__all__ = ["paged_attention", "paged_attention_ref", "write_kv", "write_kv_ref"]
