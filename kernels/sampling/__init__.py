"""Speculative sampling (docs/sampling.md): counter-based uniforms and the accept / emit rule over verify rows.
GPU kernels plug in behind the same signatures."""
from .greedy import cu_rows_of, greedy_accept_ref
from .philox import ACCEPT, DRAW, RECOVER, bits_to_uniform, philox4x32, random_bits, uniforms
from .race import exponential_race, exponential_race_ref
from .reference import speculative_sample_ref
from .speculative import greedy_accept, speculative_sample

__all__ = ["ACCEPT", "DRAW", "RECOVER", "bits_to_uniform", "exponential_race", "exponential_race_ref",
           "cu_rows_of", "greedy_accept", "greedy_accept_ref",
           "philox4x32", "random_bits",
           "speculative_sample", "speculative_sample_ref", "uniforms"]
