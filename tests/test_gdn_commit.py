"""After a verify step that accepts j of k drafts, the GDN state selected for the next step equals the state
after feeding the same j+1 tokens one at a time (DESIGN §3.4)."""
import pytest
import torch

from verifier_service.model_runner import ModelRunner
from verifier_service.sequence import Sequence

ATOL = 1e-5  # fp32 CPU: the same operations in a different grouping


def prefilled(loaded, prompt, max_drafts):
    runner = ModelRunner(loaded, num_blocks=32, block_size=4, max_seqs=2, max_drafts=max_drafts)
    seq = Sequence(0, list(prompt), len(prompt))
    runner.forward([seq], [prompt])
    seq.num_cached = len(prompt)
    return runner, seq


@pytest.mark.parametrize("k,j", [(1, 0), (1, 1), (3, 0), (3, 2), (3, 3), (4, 1)])
def test_state_after_verify_equals_sequential(tiny_model, k, j):
    prompt, last, drafts = [5, 9, 33, 7, 100, 3], 42, [17, 250, 8, 61][:k]
    runner, seq = prefilled(tiny_model, prompt, k)
    _, verify_logits = runner.forward([seq], [[last] + drafts], [k], logits=[k + 1])

    reference, ref_seq = prefilled(tiny_model, prompt, 0)
    step_logits = []
    for tok in ([last] + drafts)[: j + 1]:
        _, logits = reference.forward([ref_seq], [[tok]])
        ref_seq.num_cached += 1
        step_logits.append(logits[0])
    torch.testing.assert_close(verify_logits[: j + 1], torch.stack(step_logits), atol=1e-4, rtol=1e-5)

    width = tiny_model.config.linear_conv_kernel_dim - 1
    for rec, conv, ref_rec, ref_conv in zip(runner.caches.gdn.recurrent, runner.caches.gdn.conv,
                                            reference.caches.gdn.recurrent, reference.caches.gdn.conv):
        assert torch.allclose(rec[seq.gdn_slot, j], ref_rec[ref_seq.gdn_slot, 0], atol=ATOL)
        assert torch.allclose(conv[seq.gdn_slot, :, j:j + width], ref_conv[ref_seq.gdn_slot, :, :width], atol=ATOL)


def test_next_step_reads_the_accepted_slot(tiny_model):
    """Continuing from slot j after the verify gives the logits of continuing the sequential run."""
    prompt, last, drafts, j = [5, 9, 33, 7], 42, [17, 250, 8], 1
    runner, seq = prefilled(tiny_model, prompt, 3)
    runner.forward([seq], [[last] + drafts], [3], logits=[4])
    seq.num_cached += 1 + j
    seq.gdn_read_offset = j
    _, got = runner.forward([seq], [[77, 5, 6]], [2], logits=[3])

    reference, ref_seq = prefilled(tiny_model, prompt + [last] + drafts[:j], 0)
    _, want = reference.forward([ref_seq], [[77, 5, 6]], logits="all")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
