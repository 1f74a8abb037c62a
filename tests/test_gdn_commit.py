"""After a verify step that accepts j of k drafts, the GDN state the next step starts from (the kept state with the
j accepted drafts replayed from the pending ring) equals the state after feeding the same j+1 tokens one at a time
(docs/architecture.md, "One engine step"; the deferred commit of kernels/gated_delta_rule/reference.py)."""
import pytest
import torch

from kernels.gated_delta_rule import gated_delta_rule

from verifier_service.executor import Executor
from verifier_service.sequence import Sequence

ATOL = 1e-5  # fp32 CPU: the same operations in a different grouping


def prefilled(loaded, prompt, max_drafts):
    executor = Executor.build(loaded, num_blocks=32, block_size=4, max_seqs=2, max_drafts=max_drafts)
    seq = Sequence(0, list(prompt), len(prompt))
    executor.forward([seq], [prompt])
    seq.num_cached = len(prompt)
    return executor, seq


@pytest.mark.parametrize("k,j", [(1, 0), (1, 1), (3, 0), (3, 2), (3, 3), (4, 1)])
def test_state_after_verify_equals_sequential(tiny_model, k, j):
    prompt, last, drafts = [5, 9, 33, 7, 100, 3], 42, [17, 250, 8, 61][:k]
    executor, seq = prefilled(tiny_model, prompt, k)
    _, verify_logits = executor.forward([seq], [[last] + drafts], [k], logits=[k + 1])

    reference, ref_seq = prefilled(tiny_model, prompt, 0)
    step_logits = []
    for tok in ([last] + drafts)[: j + 1]:
        _, logits = reference.forward([ref_seq], [[tok]])
        ref_seq.num_cached += 1
        step_logits.append(logits[0])
    torch.testing.assert_close(verify_logits[: j + 1], torch.stack(step_logits), atol=1e-4, rtol=1e-5)

    width = tiny_model.config.linear_conv_kernel_dim - 1
    caches, ref_caches = executor.runner.caches.gdn, reference.runner.caches.gdn
    for i, layer in enumerate(gdn_layers(executor.runner)):
        next_step = len(prompt) + 1 + j                 # the position the next step starts at
        committed = replay(layer, caches.recurrent[i].clone(), caches.pending[i], seq.gdn_slot, j, next_step)
        assert torch.allclose(committed[seq.gdn_slot], ref_caches.recurrent[i][ref_seq.gdn_slot], atol=ATOL)
        assert torch.allclose(caches.conv[i][seq.gdn_slot, :, j:j + width],
                              ref_caches.conv[i][ref_seq.gdn_slot, :, :width], atol=ATOL)


def gdn_layers(runner):
    return [layer.linear_attn for layer in runner.model.layers if not layer.is_attention]


def replay(layer, state, pending, slot, j, position):
    """`state` with sequence `slot`'s j accepted drafts folded in: the replay pass of a one-token step at
    `position` (the step's own token is not run)."""
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k, layer.head_v
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    gated_delta_rule(torch.zeros(1, hk, dk), torch.zeros(1, hk, dk), torch.zeros(1, hv, dv), torch.zeros(1, hv),
                     torch.zeros(1, hv), layer.A_log, layer.dt_bias, state, pending, i32(0, 1), i32(slot), i32(j),
                     i32(0), torch.tensor([position]), 1, replay_only=True)
    return state


def test_next_step_replays_the_accepted_drafts(tiny_model):
    """Continuing with read offset j after the verify gives the logits of continuing the sequential run."""
    prompt, last, drafts, j = [5, 9, 33, 7], 42, [17, 250, 8], 1
    executor, seq = prefilled(tiny_model, prompt, 3)
    executor.forward([seq], [[last] + drafts], [3], logits=[4])
    seq.num_cached += 1 + j
    seq.gdn_read_offset = j
    _, got = executor.forward([seq], [[77, 5, 6]], [2], logits=[3])

    reference, ref_seq = prefilled(tiny_model, prompt + [last] + drafts[:j], 0)
    _, want = reference.forward([ref_seq], [[77, 5, 6]], logits="all")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_a_step_the_draft_ring_cannot_hold_is_refused(tiny_model):
    """The ring of draft inputs assumes a step with drafts is its last token plus them, and at most max_drafts of
    them: anything else is refused before it runs, and the sequence goes on unchanged."""
    executor, seq = prefilled(tiny_model, [5, 9, 33, 7], 2)
    with pytest.raises(ValueError, match="4 tokens, 2 drafts"):
        executor.forward([seq], [[1, 2, 3, 4]], [2], logits=[3])
    with pytest.raises(ValueError, match="0..2 drafts"):
        executor.forward([seq], [[1, 2, 3, 4]], [3], logits=[4])
    seq.gdn_read_offset = 3
    with pytest.raises(ValueError, match="read offset 3"):
        executor.forward([seq], [[1]])
    seq.gdn_read_offset = 0
    _, got = executor.forward([seq], [[77]])
    reference, ref_seq = prefilled(tiny_model, [5, 9, 33, 7], 0)
    _, want = reference.forward([ref_seq], [[77]])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
