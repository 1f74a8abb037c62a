"""The one-launch Triton speculative sampler against its torch reference (CPU: TRITON_INTERPRET; GPU: -m gpu).

Ragged batches mix greedy rows, coupled rows (one-hot drafters) and q rows (valid and invalid q), sequences
with 0..K drafts whose drafts agree with the target for a random prefix, forced acceptance, cut tokens, and a
vocabulary cut into several splits whose last one is partial. Integer outputs start as a sentinel, float
workspaces as NaN: an entry the kernel forgets to write, or a partial it reads before it is written, shows."""
import pytest
import torch
from kernel_cases import assert_compiles_for_hopper, load_interpreted

from kernels.sampling import DRAW, exponential_race_ref, speculative_sample_ref
from kernels.sampling.reference import row_layout

SENTINEL = -12345


@pytest.fixture
def filled_outputs(monkeypatch):
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(SENTINEL)

    monkeypatch.setattr(torch, "empty", empty)


def ragged_case(num_drafts: list[int], vocab: int, seed: int, greedy_every: int = 3, q_every: int = 2,
                forced: bool = False, device="cpu"):
    """Arguments of speculative_sample_ref for sequences with these draft counts, made on `device`. Drafts copy
    the target's own token (greedy: argmax; sampled: the coupled race) for a random number of leading rows (all
    of them for sequence 0), then differ."""
    g = torch.Generator(device=device).manual_seed(seed)
    on = dict(device=device, generator=g)
    b, width = len(num_drafts), max(num_drafts) + 1
    nd = torch.tensor(num_drafts, device=device)
    cu = torch.nn.functional.pad(torch.cumsum(nd + 1, 0), (1, 0))
    rows = int(cu[-1])
    logits = torch.randn(rows, vocab, **on) * 2
    logits[torch.rand(rows, vocab, **on) < 0.3] = float("-inf")                    # cut tokens
    logits[torch.arange(rows, device=device), torch.randint(0, vocab, (rows,), **on)] = 1.0  # one finite at least
    greedy = torch.arange(b, device=device) % greedy_every == 0
    uses_q = torch.arange(b, device=device) % q_every == 1
    seeds = torch.randint(0, 2 ** 62, (b,), **on)
    offsets = torch.randint(0, 2 ** 20, (b,), **on)
    q = torch.rand(rows, vocab, **on) ** 4
    q = q / q.sum(-1, keepdim=True)
    q[1::5, 0] = float("nan")                                                      # invalid q rows
    q[2::7] *= 1.5                                                                 # not a distribution
    seq_of_row, pos = row_layout(cu, rows)
    argmax = logits.argmax(-1)
    race = exponential_race_ref(logits, seeds[seq_of_row], offsets[seq_of_row] + pos, DRAW)
    own = torch.where(greedy[seq_of_row], argmax, race).tolist()                  # [R]
    agree = [k if s == 0 else int(torch.randint(0, k + 1, (1,), **on)) for s, k in enumerate(num_drafts)]
    starts = cu.tolist()
    drafts = torch.tensor([[(own[starts[s] + j] if j < agree[s] else (own[starts[s] + j] + 1 + j) % vocab)
                            if j < num_drafts[s] else -1 for j in range(width - 1)] for s in range(b)],
                          dtype=torch.long, device=device).view(b, width - 1)
    forced_accepts = torch.randint(0, width, (b,), **on) if forced else None
    return logits, argmax, q, drafts, nd, cu, greedy, uses_q, seeds, offsets, forced_accepts


def assert_same(got, want):
    for name, g, w in zip(("tokens", "num_accepted", "row_tokens"), got, want):
        assert torch.equal(g.cpu(), w.cpu()), f"{name}: kernel {g.tolist()} reference {w.tolist()}"


@pytest.mark.parametrize("num_drafts,vocab,seed", [
    ([3], 201, 0), ([0], 97, 1), ([3, 0, 2, 1, 3, 0], 201, 2), ([1, 4, 0, 4, 2, 2, 3], 130, 3),
    ([2] * 9, 64, 4)])
@pytest.mark.parametrize("mode", ["coupled", "with q", "forced", "all greedy"])
def test_kernel_equals_reference(num_drafts, vocab, seed, mode, filled_outputs):
    kernel = load_interpreted("kernels.sampling.speculative_triton").speculative_sample_triton
    logits, argmax, q, drafts, nd, cu, greedy, uses_q, seeds, offsets, forced = ragged_case(
        num_drafts, vocab, seed, greedy_every=1 if mode == "all greedy" else 3, forced=mode == "forced")
    if mode == "all greedy":
        logits, q = None, None
    elif mode != "with q":
        q, uses_q = None, torch.zeros_like(uses_q)
    seeds, offsets = torch.stack([seeds, offsets], 1).unbind(1)       # strided views, as SamplingBatch has
    want = speculative_sample_ref(logits, argmax, q, drafts, nd, cu, greedy, uses_q, seeds, offsets, forced)
    got = kernel(logits, argmax, q, drafts, nd, cu, greedy, uses_q, seeds, offsets, forced, split=64, block=32)
    assert_same(got, want)
    if mode == "coupled" and max(num_drafts) > 0:
        assert int(want[1].sum()) > 0, "the case accepts nothing: it would not check the leading run"


@pytest.mark.parametrize("mode", ["coupled", "all greedy"])
def test_more_sequences_than_one_lookup_block(mode):
    """300 sequences: a row finds its sequence over two 256-wide blocks of cu_rows."""
    kernel = load_interpreted("kernels.sampling.speculative_triton").speculative_sample_triton
    logits, argmax, _, drafts, nd, cu, greedy, uses_q, seeds, offsets, _ = ragged_case(
        [s % 4 for s in range(300)], 64, 9, greedy_every=1 if mode == "all greedy" else 3)
    logits = None if mode == "all greedy" else logits
    uses_q = torch.zeros_like(uses_q)
    want = speculative_sample_ref(logits, argmax, None, drafts, nd, cu, greedy, uses_q, seeds, offsets)
    assert_same(kernel(logits, argmax, None, drafts, nd, cu, greedy, uses_q, seeds, offsets, split=64, block=64), want)


def test_q_rows_take_the_acceptance_test_and_the_residual():
    """A q row with a valid q differs from the coupled draw (it is not what the one-hot rule would give on
    every seed), and the kernel follows it: over seeds, the same accepted counts and tokens as the reference."""
    kernel = load_interpreted("kernels.sampling.speculative_triton").speculative_sample_triton
    differs = 0
    for seed in range(6):
        logits, argmax, q, drafts, nd, cu, greedy, uses_q, seeds, offsets, _ = ragged_case(
            [2, 2], 50, 100 + seed, greedy_every=99, q_every=1)
        uses_q[:] = True
        want = speculative_sample_ref(logits, argmax, q, drafts, nd, cu, greedy, uses_q, seeds, offsets)
        got = kernel(logits, argmax, q, drafts, nd, cu, greedy, uses_q, seeds, offsets, split=16, block=16)
        assert_same(got, want)
        one_hot = speculative_sample_ref(logits, argmax, None, drafts, nd, cu, greedy, uses_q, seeds, offsets)
        differs += not torch.equal(one_hot[0], want[0])
    assert differs > 0, "q never changed the verdict: the case does not exercise the q path"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("mode", ["coupled", "with q", "all greedy"])
def test_kernel_at_the_4b_vocabulary(batch, mode, cuda):
    from kernels.sampling.speculative_triton import speculative_sample_triton
    num_drafts = [3 - (s % 4 == 3) * 3 for s in range(batch)]
    logits, argmax, q, drafts, nd, cu, greedy, uses_q, seeds, offsets, _ = ragged_case(
        num_drafts, 248320, batch, greedy_every=1 if mode == "all greedy" else 3, device=cuda)
    if mode == "all greedy":
        logits, q = None, None
    elif mode != "with q":
        q, uses_q = None, torch.zeros_like(uses_q)
    want = speculative_sample_ref(logits, argmax, q, drafts, nd, cu, greedy, uses_q, seeds, offsets)
    for _ in range(3):  # the finishing program differs from launch to launch
        assert_same(speculative_sample_triton(logits, argmax, q, drafts, nd, cu, greedy, uses_q, seeds, offsets),
                     want)


def test_the_kernel_compiles_for_hopper_in_every_mode(tmp_path):
    """The interpreter accepts code the compiler rejects: compile for sm_90 on the CPU, in each mode."""
    import kernels.sampling.speculative_triton as m
    types = dict(logits_ptr="*fp32", q_ptr="*fp32", greedy_tokens_ptr="*i64", drafts_ptr="*i64",
                 num_drafts_ptr="*i64", cu_rows_ptr="*i64", greedy_ptr="*i1", uses_q_ptr="*i1", seeds_ptr="*i64",
                 offsets_ptr="*i64", forced_ptr="*i64", part_f_ptr="*fp32", part_i_ptr="*i32",
                 row_stats_ptr="*fp32", counter_ptr="*i32", tokens_ptr="*i64", accepted_ptr="*i64",
                 row_tokens_ptr="*i64")
    modes = [dict(HAS_LOGITS=has_logits, HAS_Q=has_q, HAS_FORCED=forced, BLOCK_B=256, BLOCK_S=32, BLOCK_W=8,
                  SPLIT=m.SPLIT, BLOCK=m.BLOCK)
             for has_logits, has_q, forced in ((False, False, False), (True, False, False), (True, True, False),
                                               (True, False, True))]
    assert_compiles_for_hopper(tmp_path, "kernels.sampling.speculative_triton", "_speculative_kernel", types, modes)
