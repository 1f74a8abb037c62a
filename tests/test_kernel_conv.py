"""Causal conv1d with the speculative window: the vectorised torch reference against a per-sequence loop written
from the math, and the Triton kernel (TRITON_INTERPRET=1 on CPU; compiled on the GPU at the 4B shape) against
the reference. Ragged batches with padding sequences and tail tokens, k = 0..4, read offsets, odd channel
counts, outputs pre-filled with NaN; the history columns a step must not read hold NaN."""
import pytest
import torch
import torch.nn.functional as F
from kernel_cases import (CASES, GPU_CASES, RaggedCase, assert_compiles_for_hopper, assert_state_equal,
                          load_interpreted)

from kernels.causal_conv1d import causal_conv1d_ref, conv_state_columns

NAN = float("nan")


def make_inputs(case: RaggedCase, channels=40, width=4, device="cpu", dtype=torch.float32, seed=0, layout="columns"):
    """layout: "columns" (the caches', conv_state_columns) or "channels" (each channel's window contiguous)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(case.num_tokens, channels + 8, generator=g)[:, 3:3 + channels]   # a row-strided view
    weight = torch.randn(channels, width, generator=g)
    state = torch.randn(case.num_slots, channels, width - 1 + case.max_drafts, generator=g)
    if layout == "columns":
        state = conv_state_columns(*state.shape).copy_(state)
    for b_idx, slot in enumerate(case.slot_list):
        if case.lens[b_idx]:
            off = case.offset_list[b_idx]
            state[slot, :, :off] = NAN                       # columns outside [off, off + W-1) are never read
            state[slot, :, off + width - 1:] = NAN
    state = state.to(device, dtype)   # (keeps the layout: a dense tensor's strides are preserved)
    assert (state.stride(1) == 1) == (layout == "columns")
    return x.to(device, dtype), weight.to(device, dtype), state


def loop_spec(x, weight, state, case: RaggedCase):
    """docs/architecture.md window rule, one sequence at a time; returns (out for the real tokens, new state)."""
    state, width = state.clone(), weight.shape[1]
    out = torch.zeros(case.num_tokens, x.shape[1])
    for b_idx, rows in case.token_ranges():
        slot, off, d, n = case.slot_list[b_idx], case.offset_list[b_idx], case.drafts[b_idx], len(rows)
        xs = torch.cat([state[slot, :, off:off + width - 1], x[rows.start:rows.stop].t()], dim=1)  # [C, W-1+n]
        y = F.conv1d(xs[None].float(), weight.float()[:, None, :], groups=xs.shape[0])[0]           # [C, n]
        out[rows.start:rows.stop] = F.silu(y).t()
        keep = xs[:, n - d:]
        state[slot, :, :keep.shape[1]] = keep
    return out, state


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("layout", ["columns", "channels"])
def test_reference_matches_the_per_sequence_loop(name, layout):
    case = CASES[name]
    x, weight, state = make_inputs(case, layout=layout)
    want_out, want_state = loop_spec(x, weight, state, case)
    out = causal_conv1d_ref(x, weight, state, *case.tensors(), case.max_seqlen)
    real = case.real_token_mask()
    torch.testing.assert_close(out[real], want_out[real], atol=1e-5, rtol=1e-4)
    assert_state_equal(state, want_state, atol=1e-6)


@pytest.fixture(scope="module")
def interpreted():
    return load_interpreted("kernels.causal_conv1d.triton_conv")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block_c,layout", [(16, "columns"), (64, "columns"), (16, "channels")])
def test_triton_interpreter_matches_reference(interpreted, name, block_c, layout):
    case = CASES[name]
    x, weight, state = make_inputs(case, seed=3, layout=layout)
    ref_state = state.clone()
    want = causal_conv1d_ref(x, weight, ref_state, *case.tensors(), case.max_seqlen)
    out = torch.full_like(want, NAN)
    interpreted.causal_conv1d_triton(x, weight, state, *case.tensors(), case.max_seqlen, block_c=block_c, out=out)
    real = case.real_token_mask()
    torch.testing.assert_close(out[real], want[real], atol=1e-5, rtol=1e-4)
    assert_state_equal(state, ref_state, atol=1e-6)


@pytest.mark.parametrize("case", [RaggedCase([37, 2], [0, 1], 1, 3, seed=11),
                                  RaggedCase([40, 0, 3, 33, 0], [0, 0, 2, 0, 0], 2, 6, tail=7, seed=12)],
                         ids=["chunk-and-verify", "padding-and-tail"])
def test_triton_interpreter_long_prefill_crosses_token_tiles(interpreted, case):
    """Prompt chunks beside verify steps, more rows than one tile (32), padding sequences and tail rows: the
    history is read by the first tile, the window written after."""
    x, weight, state = make_inputs(case, channels=24, width=3, seed=4)
    ref_state = state.clone()
    want = causal_conv1d_ref(x, weight, ref_state, *case.tensors(), case.max_seqlen)
    out = interpreted.causal_conv1d_triton(x, weight, state, *case.tensors(), case.max_seqlen)
    real = case.real_token_mask()
    torch.testing.assert_close(out[real], want[real], atol=1e-5, rtol=1e-4)
    assert_state_equal(state, ref_state, atol=1e-6)


def test_an_overlapping_window_is_refused(interpreted):
    """A window whose columns or channels share memory (an expanded tensor) would race in the in-place update."""
    case = CASES[next(iter(CASES))]
    x, weight, state = make_inputs(case)
    shared = state[:, :1].expand(-1, state.shape[1], -1)             # every channel the same memory
    with pytest.raises(ValueError, match="without overlap"):
        interpreted.causal_conv1d_triton(x, weight, shared, *case.tensors(), case.max_seqlen)


def test_the_kernels_compile_for_hopper(tmp_path):
    """The interpreter accepts code the compiler rejects: compile both kernels for sm_90 on the CPU, 4B shape."""
    types = dict(x_ptr="*bf16", w_ptr="*bf16", state_ptr="*bf16", out_ptr="*bf16", cu_seqlens_ptr="*i32",
                 slots_ptr="*i32", read_offsets_ptr="*i32", num_drafts_ptr="*i32")
    module = "kernels.causal_conv1d.triton_conv"
    # (a stride of 1 is a constant at launch: the caches' layout, a column's channels contiguous, compiles so)
    assert_compiles_for_hopper(tmp_path, module, "_conv_out_kernel", types,
                               [dict(C=8192, W=4, BC=64, BT=32, BLOCK_SEQS=64),
                                dict(C=8192, W=4, BC=64, BT=32, BLOCK_SEQS=64, stride_s_c=1)])
    assert_compiles_for_hopper(tmp_path, module, "_conv_window_kernel", types,
                               [dict(C=8192, W=4, BC=64, BW=8), dict(C=8192, W=4, BC=64, BW=8, stride_s_c=1)])


# ---- GPU, 4B shape: conv over [q, k, v] = 2 × 16 × 128 + 32 × 128 = 8192 channels, kernel 4 -------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_kernel_matches_reference_4b_shape(name, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    case = GPU_CASES[name]
    x, weight, state = make_inputs(case, channels=8192, device="cuda", dtype=dtype)
    ref_state = state.clone()
    want = causal_conv1d_ref(x, weight, ref_state, *case.tensors("cuda"), case.max_seqlen)
    out = torch.full_like(want, NAN)
    from kernels.causal_conv1d.triton_conv import causal_conv1d_triton
    causal_conv1d_triton(x, weight, state, *case.tensors("cuda"), case.max_seqlen, out=out)
    real = case.real_token_mask().cuda()
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[real].float(), want[real].float(), **tol)
    assert torch.equal(state.isnan(), ref_state.isnan())
    assert torch.equal(state.nan_to_num(), ref_state.nan_to_num())  # the window is copied, not computed
