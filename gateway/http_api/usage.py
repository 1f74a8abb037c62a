"""`usage` of an OpenAI response (prompt tokens from the prefix cache in `prompt_tokens_details`), with the
speculative-decoding figures as an extra field (`spec_decode`)."""
from __future__ import annotations


def usage_json(usage) -> dict:
    """A gateway_pb2.Usage as OpenAI's usage object plus `spec_decode` (drafts, acceptance rate and length)."""
    drafted, accepted, steps = usage.draft_tokens, usage.accepted_tokens, usage.verify_steps
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},   # from the verifier's prefix cache
        "spec_decode": {
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "verify_steps": steps,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / steps if steps else None,   # tokens per verify step
            "queue_seconds": usage.queue_seconds,
        },
    }
