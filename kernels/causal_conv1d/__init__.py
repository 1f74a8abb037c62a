"""Causal depthwise conv1d + SiLU: public entry point (GPU kernels plug in behind the same signature)."""
from .reference import causal_conv1d_ref

causal_conv1d = causal_conv1d_ref

__all__ = ["causal_conv1d", "causal_conv1d_ref"]
