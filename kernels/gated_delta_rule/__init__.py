"""Gated delta rule (DESIGN §2): public entry point. GPU kernels plug in here behind the same signature."""
from .reference import gated_delta_rule_ref, l2norm

gated_delta_rule = gated_delta_rule_ref

__all__ = ["gated_delta_rule", "gated_delta_rule_ref", "l2norm"]
