"""Gated delta rule: the vectorised torch reference against a per-token loop written from the math, and the
Triton kernel (TRITON_INTERPRET=1 on CPU; compiled on the GPU at the 4B shape) against the reference.
Ragged batches with 0-length padding sequences, tail tokens, k = 0..4 drafts, read offsets, non-power-of-two
head dims, outputs pre-filled with NaN and unused state slots poisoned with NaN."""
import pytest
import torch
import torch.nn.functional as F
from kernel_cases import CASES, GPU_CASES, RaggedCase, assert_state_equal, load_interpreted

from kernels.gated_delta_rule import gated_delta_rule, gated_delta_rule_ref

NAN = float("nan")


def make_inputs(case: RaggedCase, hk=2, hv=4, dk=24, dv=40, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    t = case.num_tokens
    mixed = rand(t, 2 * hk * dk + hv * dv)                     # q/k/v as strided views, like the model's
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv)
    ab = rand(t, 2 * hv)
    a, b = ab[:, :hv], ab[:, hv:]
    A_log, dt_bias = (torch.rand(hv, generator=g) * 2 - 1).to(device), rand(hv).float()
    state = torch.randn(case.num_slots, 1 + case.max_drafts, hv, dk, dv, generator=g).to(device)
    for b_idx, slot in enumerate(case.slot_list):      # slots a step must not read: NaN
        if case.lens[b_idx]:
            for j in range(1 + case.max_drafts):
                if j != case.offset_list[b_idx]:
                    state[slot, j] = NAN
    return q, k, v, a, b, A_log.to(dtype), dt_bias.to(dtype), state


def loop_spec(q, k, v, a, b, A_log, dt_bias, state, case: RaggedCase):
    """DESIGN §2 per token, one sequence at a time; returns (out for the real tokens, new state)."""
    state = state.clone()
    group = v.shape[1] // q.shape[1]
    out = torch.zeros(case.num_tokens, v.shape[1], v.shape[2])
    for b_idx, rows in case.token_ranges():
        slot, d = case.slot_list[b_idx], case.drafts[b_idx]
        s = state[slot, case.offset_list[b_idx]].clone()
        for i, t in enumerate(rows):
            gt = -A_log.float().exp() * F.softplus(a[t].float() + dt_bias.float())
            beta = torch.sigmoid(b[t].float())
            qt = F.normalize(q[t].float(), dim=-1, eps=0).repeat_interleave(group, 0) * q.shape[2] ** -0.5
            kt = F.normalize(k[t].float(), dim=-1, eps=0).repeat_interleave(group, 0)
            s = s * gt.exp()[:, None, None]
            delta = beta[:, None] * (v[t].float() - torch.einsum("hkv,hk->hv", s, kt))
            s = s + kt[:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qt)
            if i >= len(rows) - 1 - d:
                state[slot, i - (len(rows) - 1 - d)] = s
    return out, state


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_the_per_token_loop(name):
    case = CASES[name]
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(case)
    want_out, want_state = loop_spec(q, k, v, a, b, A_log, dt_bias, state, case)
    out = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, state, *case.tensors(), case.max_seqlen)
    real = case.real_token_mask()
    torch.testing.assert_close(out[real], want_out[real], atol=1e-5, rtol=1e-4)
    assert_state_equal(state, want_state, atol=1e-5)


@pytest.fixture(scope="module")
def interpreted():
    return load_interpreted("kernels.gated_delta_rule.fused_recurrent")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block_v", [8, 16, 32])  # 32: a partial last block at V = 40
@pytest.mark.parametrize("pipeline", [False, True], ids=["loop", "pipelined"])
def test_triton_interpreter_matches_reference(interpreted, name, block_v, pipeline):
    case = CASES[name]
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(case, seed=5)
    ref_state = state.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, ref_state, *case.tensors(), case.max_seqlen)
    out = torch.full_like(want, NAN)
    interpreted.gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, state, *case.tensors(), case.max_seqlen,
                                        block_v=block_v, pipeline=pipeline, out=out)
    real = case.real_token_mask()
    torch.testing.assert_close(out[real], want[real], atol=1e-5, rtol=1e-4)
    assert_state_equal(state, ref_state, atol=1e-5)


def test_triton_save_none_writes_no_state(interpreted):
    """The recompute-at-commit variant (benchmark only): same outputs, state untouched."""
    case = CASES["verify-k0..4"]
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(case, seed=6)
    before = state.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, state.clone(), *case.tensors(), case.max_seqlen)
    out = interpreted.gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, state, *case.tensors(),
                                              case.max_seqlen, save=interpreted.SAVE_NONE)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(state.isnan(), before.isnan()) and torch.equal(state.nan_to_num(), before.nan_to_num())


# ---- GPU, 4B shape: 16 key heads / 32 value heads × 128 ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("dtype,config", [  # every launch_config choice in fp32; bf16 as the engine picks
    (torch.float32, None), (torch.float32, (16, 1, True)), (torch.float32, (16, 1, False)),
    (torch.float32, (32, 2, False)), (torch.bfloat16, None)],
    ids=["fp32-auto", "fp32-bv16w1-pipelined", "fp32-bv16w1", "fp32-bv32w2", "bf16-auto"])
def test_gpu_kernel_matches_reference_4b_shape(name, dtype, config):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    case = GPU_CASES[name]
    inputs = make_inputs(case, hk=16, hv=32, dk=128, dv=128, device="cuda", dtype=dtype)
    q, k, v, a, b, A_log, dt_bias, state = inputs
    ref_state = state.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, ref_state, *case.tensors("cuda"), case.max_seqlen)
    if config is None:
        out = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, *case.tensors("cuda"), case.max_seqlen)
    else:
        from kernels.gated_delta_rule.fused_recurrent import gated_delta_rule_triton
        bv, warps, pipeline = config
        out = gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, state, *case.tensors("cuda"), case.max_seqlen,
                                      block_v=bv, num_warps=warps, pipeline=pipeline)
    real = case.real_token_mask().cuda()
    tol = dict(atol=2e-4, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out[real].float(), want[real].float(), **tol)
    assert torch.equal(state.isnan(), ref_state.isnan())
    torch.testing.assert_close(state.nan_to_num(), ref_state.nan_to_num(), atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_gpu_fla_chunk_prefill_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kernels.gated_delta_rule.chunk import chunk_gated_delta_rule_fla, fla_chunk_kernel
    if fla_chunk_kernel() is None:
        pytest.skip("fla-core not installed")
    case = RaggedCase([300, 17, 1, 129], [0, 0, 0, 0], 3, 5, seed=10)
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(case, hk=16, hv=32, dk=128, dv=128, device="cuda")
    state = state.nan_to_num()  # fla reads only slot[read_offset] too, but keep its inputs finite
    ref_state = state.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, ref_state, *case.tensors("cuda"), case.max_seqlen)
    tensors = case.tensors("cuda")
    before = state.clone()
    out = chunk_gated_delta_rule_fla(q, k, v, a, b, A_log, dt_bias, state, *tensors, case.max_seqlen)
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)  # tf32 dots, chunked sums; a wrong slot is O(1)
    torch.testing.assert_close(state, ref_state, atol=1e-2, rtol=1e-2)
    # with the offsets from the host (the engine's path: no read-back), twice (the cached index): same results
    for _ in range(2):
        again = before.clone()
        out_host = chunk_gated_delta_rule_fla(q, k, v, a, b, A_log, dt_bias, again, *tensors, case.max_seqlen,
                                              cu_seqlens_host=tensors[0].cpu().numpy())
        torch.testing.assert_close(out_host, out, atol=1e-5, rtol=1e-5)  # a wrong index is O(1)
        torch.testing.assert_close(again, state, atol=1e-5, rtol=1e-5)
