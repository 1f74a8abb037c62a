"""Gated delta rule: the vectorised torch reference against a per-token loop written from the math (the deferred
commit: replay the last step's accepted drafts from the pending ring, keep the state after the step's last
non-draft token, stash the step's drafts), and the Triton kernel (TRITON_INTERPRET=1 on CPU; compiled on the GPU
at the 4B shape) against the reference. Ragged batches with 0-length padding sequences, tail tokens, k = 0..4
drafts, 0..k replayed drafts, non-power-of-two head dims, outputs pre-filled with NaN, ring entries a step must
not read and the padding sequences' scratch state poisoned with NaN."""
import pytest
import torch
import torch.nn.functional as F
from kernel_cases import (CASES, GPU_CASES, RaggedCase, assert_compiles_for_hopper, assert_state_equal,
                          load_interpreted)

from kernels.gated_delta_rule import gated_delta_rule, gated_delta_rule_ref
from specdec.models.caches import pending_ring_rows

NAN = float("nan")


def make_inputs(case: RaggedCase, hk=2, hv=4, dk=24, dv=40, device="cpu", dtype=torch.float32, seed=0):
    """(q, k, v, a, b, A_log, dt_bias, state, pending): the kernel's inputs before the ragged-batch tensors."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    t = case.num_tokens
    mixed = rand(t, 2 * hk * dk + hv * dv)                     # q/k/v as strided views, like the model's
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv)
    ab = rand(t, 2 * hv)
    a, b = ab[:, :hv], ab[:, hv:]
    A_log, dt_bias = (torch.rand(hv, generator=g) * 2 - 1).to(device), rand(hv).float()
    state = torch.randn(case.num_slots, hv, dk, dv, generator=g).to(device)
    state[case.num_slots - 1] = NAN                              # the scratch slot of padding sequences
    ring = pending_ring_rows(case.max_drafts)
    pending = rand(case.num_slots, ring, hk * dk + hv * (dv + 2))
    for b_idx, slot in enumerate(case.slot_list):                # ring entries a step must not read: NaN
        if case.lens[b_idx]:
            start, j = case.start_list[b_idx], case.offset_list[b_idx]
            for e in set(range(ring)) - {p % ring for p in range(start - j, start)}:
                pending[slot, e] = NAN
    return q, k, v, a, b, A_log, dt_bias.to(dtype), state, pending


def args_of(case: RaggedCase, device="cpu"):
    """The ragged-batch arguments after `pending`: cu_seqlens, slots, read_offsets, num_drafts, positions,
    max_seqlen."""
    return (*case.tensors(device), case.positions(device), case.max_seqlen)


def token_update(s, kt, vt, at, bt, A_log, dt_bias, group):
    """One token of the gated delta rule (docs/architecture.md, "The model") on one sequence's state [HV, K, V]."""
    gt = -A_log.float().exp() * F.softplus(at.float() + dt_bias.float())
    beta = torch.sigmoid(bt.float())
    kt = F.normalize(kt.float(), dim=-1, eps=0).repeat_interleave(group, 0)
    s = s * gt.exp()[:, None, None]
    return s + kt[:, :, None] * (beta[:, None] * (vt.float() - torch.einsum("hkv,hk->hv", s, kt)))[:, None, :]


def replayed(state, pending, A_log, dt_bias, case: RaggedCase, b_idx, hk, dk):
    """Sequence b_idx's state after the drafts of its last step it accepted (ring entries start - j .. start - 1)."""
    slot, j, start = case.slot_list[b_idx], case.offset_list[b_idx], case.start_list[b_idx]
    hv, ring = A_log.shape[0], pending.shape[1]
    dv = (pending.shape[2] - hk * dk) // hv - 2
    s = state[slot].clone()
    for p in range(start - j, start):
        kr, vr, ar, br = pending[slot, p % ring].split([hk * dk, hv * dv, hv, hv])
        s = token_update(s, kr.view(hk, dk), vr.view(hv, dv), ar, br, A_log, dt_bias, hv // hk)
    return s


def loop_spec(q, k, v, a, b, A_log, dt_bias, state, pending, case: RaggedCase):
    """The gated delta rule per token, one sequence at a time; returns (out for the real tokens, new state, new
    pending)."""
    state, pending = state.clone(), pending.clone()
    hk, dk, hv = q.shape[1], q.shape[2], v.shape[1]
    group, ring = hv // hk, pending.shape[1]
    out = torch.zeros(case.num_tokens, hv, v.shape[2])
    for b_idx, rows in case.token_ranges():
        slot, d, start = case.slot_list[b_idx], case.drafts[b_idx], case.start_list[b_idx]
        s = replayed(state, pending, A_log, dt_bias, case, b_idx, hk, dk)
        for i, t in enumerate(rows):
            s = token_update(s, k[t], v[t], a[t], b[t], A_log, dt_bias, group)
            qt = F.normalize(q[t].float(), dim=-1, eps=0).repeat_interleave(group, 0) * dk ** -0.5
            out[t] = torch.einsum("hkv,hk->hv", s, qt)
            if i == len(rows) - 1 - d:
                state[slot] = s                                               # the step's last non-draft token
            if i > len(rows) - 1 - d:                                         # a draft: stashed at its position
                pending[slot, (start + i) % ring] = torch.cat([k[t].flatten(), v[t].flatten(), a[t], b[t]])
    return out, state, pending


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_the_per_token_loop(name):
    case = CASES[name]
    q, k, v, a, b, A_log, dt_bias, state, pending = make_inputs(case)
    want_out, want_state, want_pending = loop_spec(q, k, v, a, b, A_log, dt_bias, state, pending, case)
    out = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, state, pending, *args_of(case))
    real = case.real_token_mask()
    torch.testing.assert_close(out[real], want_out[real], atol=1e-5, rtol=1e-4)
    assert_state_equal(state, want_state, atol=1e-5)
    assert_state_equal(pending, want_pending, atol=0)


@pytest.fixture(scope="module")
def interpreted():
    return load_interpreted("kernels.gated_delta_rule.fused_recurrent")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block_v", [8, 16, 32])  # 32: a partial last block at V = 40
@pytest.mark.parametrize("pipeline", [False, True], ids=["loop", "pipelined"])
def test_triton_interpreter_matches_reference(interpreted, name, block_v, pipeline):
    case = CASES[name]
    q, k, v, a, b, A_log, dt_bias, state, pending = make_inputs(case, seed=5)
    ref_state, ref_pending = state.clone(), pending.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, ref_state, ref_pending, *args_of(case))
    out = torch.full_like(want, NAN)
    interpreted.gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, state, pending, *args_of(case),
                                        block_v=block_v, pipeline=pipeline, out=out)
    real = case.real_token_mask()
    torch.testing.assert_close(out[real], want[real], atol=1e-5, rtol=1e-4)
    assert_state_equal(state, ref_state, atol=1e-5)
    assert_state_equal(pending, ref_pending, atol=0)


def test_the_launch_config_counts_the_replays_the_caller_bounds(interpreted, monkeypatch):
    """`max_replays` (the most drafts a sequence of the step replays, known on the host) is what the launch config
    adds to the step's tokens; unknown (None), every replay the ring allows (R / 2 - 1). A single-token step
    with nothing to replay then takes the variant chosen for single tokens."""
    case = CASES["decode-b1"]                                  # one token, k = 0 engine
    seen = []
    real = interpreted.launch_config
    monkeypatch.setattr(interpreted, "launch_config", lambda n, tokens: seen.append((n, tokens)) or real(n, tokens))
    q, k, v, a, b, A_log, dt_bias, state, _ = make_inputs(case, seed=3)
    ring = pending_ring_rows(3)                                # an engine that verifies up to 3 drafts
    pending = torch.zeros(case.num_slots, ring, q.shape[1] * q.shape[2] + v.shape[1] * (v.shape[2] + 2))
    results = []
    for max_replays in (None, 0, 1, 99):
        results.append(interpreted.gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, state.clone(),
                                                           pending.clone(), *args_of(case), max_replays=max_replays))
    assert seen == [(1, 1 + ring // 2 - 1), (1, 1), (1, 2), (1, 1 + ring // 2 - 1)]
    assert real(1, 1) != real(1, 1 + ring // 2 - 1)            # the two variants differ where this matters
    for out in results[1:]:
        torch.testing.assert_close(out, results[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("pipeline", [False, True], ids=["loop", "pipelined"])
def test_replay_only_folds_the_accepted_drafts_in(interpreted, pipeline):
    """What the chunked prefill runs first: state[slot] becomes the state after the replayed drafts; no token runs,
    nothing is stashed, the output is untouched."""
    case = CASES["verify-padded"]
    q, k, v, a, b, A_log, dt_bias, state, pending = make_inputs(case, seed=7)
    before, want_state = pending.clone(), state.clone()
    for b_idx, _ in case.token_ranges():
        want_state[case.slot_list[b_idx]] = replayed(state, pending, A_log, dt_bias, case, b_idx, q.shape[1],
                                                     q.shape[2])
    ref_state = state.clone()
    gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, ref_state, pending.clone(), *args_of(case), replay_only=True)
    assert_state_equal(ref_state, want_state, atol=1e-5)
    out = torch.full((case.num_tokens, v.shape[1], v.shape[2]), NAN)
    interpreted.gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, state, pending, *args_of(case),
                                        replay_only=True, pipeline=pipeline, out=out)
    assert_state_equal(state, want_state, atol=1e-5)
    assert_state_equal(pending, before, atol=0)
    assert out.isnan().all()


@pytest.mark.parametrize("pipeline", [False, True], ids=["loop", "pipelined"])
def test_skipped_sequences_are_left_alone(interpreted, pipeline):
    """A mixed step's chunk lanes: the recurrent kernel leaves their sequences to the chunked kernel (state, ring
    and outputs untouched; an unused lane, -1, skips nothing) and runs every other sequence as before."""
    case = CASES["mixed-prefill-verify"]                      # lens 9 (the lane), 3 (2 drafts), 1
    q, k, v, a, b, A_log, dt_bias, state, pending = make_inputs(case, seed=11)
    ref_state, ref_pending = state.clone(), pending.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, ref_state, ref_pending, *args_of(case))
    before_state, before_pending = state.clone(), pending.clone()
    lane_slot = case.slot_list[0]
    skip = torch.tensor([[0, 0, 9, lane_slot], [-1, 0, 0, case.num_slots - 1]], dtype=torch.int32)
    out = torch.full_like(want, NAN)
    interpreted.gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, state, pending, *args_of(case),
                                        pipeline=pipeline, out=out, skip=skip)
    assert out[:9].isnan().all()
    real = case.real_token_mask()
    real[:9] = False
    torch.testing.assert_close(out[real], want[real], atol=1e-5, rtol=1e-4)
    for slot in range(case.num_slots):
        if slot == lane_slot:
            assert_state_equal(state[slot], before_state[slot], atol=0)
            assert_state_equal(pending[slot], before_pending[slot], atol=0)
        else:
            assert_state_equal(state[slot], ref_state[slot], atol=1e-5)
            assert_state_equal(pending[slot], ref_pending[slot], atol=0)


def test_the_kernel_compiles_for_hopper_in_every_mode(tmp_path):
    """The interpreter accepts code the compiler rejects: compile for sm_90 on the CPU, 4B shape, bf16 inputs,
    in every loop mode and both value-slice widths the launch rule picks, with and without sequences to skip."""
    types = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "A_log_ptr", "dt_bias_ptr",
                                         "pending_ptr", "out_ptr")}
    types |= dict(state_ptr="*fp32", cu_seqlens_ptr="*i32", slots_ptr="*i32", read_offsets_ptr="*i32",
                  num_drafts_ptr="*i32", positions_ptr="*i64", skip_ptr="*i32", scale="fp32")
    modes = [dict(HK=16, HV=32, GROUP=2, K=128, V=128, R=8, BK=128, BV=bv, PIPELINE=pipeline, REPLAY_ONLY=replay,
                  NUM_SKIP=skip)
             for bv, pipeline, replay, skip in ((16, True, False, 0), (16, False, False, 0), (32, False, False, 0),
                                                (16, True, True, 0), (16, True, False, 2))]
    assert_compiles_for_hopper(tmp_path, "kernels.gated_delta_rule.fused_recurrent", "_gdn_recurrent_kernel", types,
                               modes)


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
    q, k, v, a, b, A_log, dt_bias, state, pending = make_inputs(case, hk=16, hv=32, dk=128, dv=128, device="cuda",
                                                                dtype=dtype)
    ref_state, ref_pending = state.clone(), pending.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, ref_state, ref_pending, *args_of(case, "cuda"))
    if config is None:
        out = gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, pending, *args_of(case, "cuda"))
    else:
        from kernels.gated_delta_rule.fused_recurrent import gated_delta_rule_triton
        bv, warps, pipeline = config
        out = gated_delta_rule_triton(q, k, v, a, b, A_log, dt_bias, state, pending, *args_of(case, "cuda"),
                                      block_v=bv, num_warps=warps, pipeline=pipeline)
    real = case.real_token_mask().cuda()
    tol = dict(atol=2e-4, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out[real].float(), want[real].float(), **tol)
    assert torch.equal(state.isnan(), ref_state.isnan())
    torch.testing.assert_close(state.nan_to_num(), ref_state.nan_to_num(), atol=1e-3, rtol=1e-3)
    assert torch.equal(pending.isnan(), ref_pending.isnan())
    assert torch.equal(pending.nan_to_num(), ref_pending.nan_to_num())


@pytest.mark.gpu
def test_gpu_chunk_lanes_match_reference():
    """A mixed step at the 4B shape: a 300-token chunk (the lane, row 0..300) and a 150-token one (a second lane
    when CHUNK_LANES allows it, else the recurrent kernel's) beside verify steps with drafts and replays, padding
    at the end; the lanes' dispatch gives the reference's outputs and states, in a CUDA graph too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kernels.gated_delta_rule import gated_delta_rule_lanes
    from kernels.gated_delta_rule.chunk import fla_chunk_kernel
    from specdec.models.forward_batch import CHUNK_LANES
    assert fla_chunk_kernel() is not None, "the GPU image carries fla-core (.whl)"
    case = RaggedCase([300, 4, 4, 150, 2, 1, 0], [0, 3, 3, 0, 1, 0, 0], 3, 9, tail=20, seed=12)
    case.offset_list[0] = case.offset_list[3] = 0                 # a lane has nothing to replay
    q, k, v, a, b, A_log, dt_bias, state, pending = make_inputs(case, hk=16, hv=32, dk=128, dv=128, device="cuda")
    state, pending = state.nan_to_num(), pending.nan_to_num()
    ref_state, ref_pending = state.clone(), pending.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, ref_state, ref_pending, *args_of(case, "cuda"))
    lanes = [[0, 0, 300, case.slot_list[0]], [3, 308, 458, case.slot_list[3]]][:CHUNK_LANES]
    lanes += [[-1, 0, 0, case.num_slots - 1]] * (CHUNK_LANES - len(lanes))
    lanes = torch.tensor(lanes, dtype=torch.int32, device="cuda")
    start_state, start_pending = state.clone(), pending.clone()
    ragged = args_of(case, "cuda")                                 # built before the capture (host copies)

    def step():
        return gated_delta_rule_lanes(q, k, v, a, b, A_log, dt_bias, state, pending, *ragged, chunk_lanes=lanes)
    out = step()
    real = case.real_token_mask()
    torch.testing.assert_close(out[real], want[real], atol=1e-2, rtol=1e-2)   # chunked sums; a wrong state is O(1)
    torch.testing.assert_close(state, ref_state, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(pending, ref_pending, atol=0, rtol=0)
    state.copy_(start_state), pending.copy_(start_pending)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    state.copy_(start_state), pending.copy_(start_pending)
    graph.replay()
    torch.testing.assert_close(captured[real], out[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_fla_chunk_prefill_matches_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kernels.gated_delta_rule import gated_delta_rule_prefill
    from kernels.gated_delta_rule.chunk import chunk_gated_delta_rule_fla, fla_chunk_kernel
    if fla_chunk_kernel() is None:
        pytest.skip("fla-core not installed")
    case = RaggedCase([300, 17, 1, 129], [0, 0, 0, 0], 3, 5, seed=10)
    q, k, v, a, b, A_log, dt_bias, state, pending = make_inputs(case, hk=16, hv=32, dk=128, dv=128, device="cuda")
    state, pending = state.nan_to_num(), pending.nan_to_num()   # keep fla's inputs finite
    ref_state = state.clone()
    want = gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, ref_state, pending.clone(), *args_of(case, "cuda"))
    before = state.clone()
    # the engine's entry point: replayed drafts folded in first (the case replays 0..3 of them), then fla
    out = gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, state, pending, *args_of(case, "cuda"))
    torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)  # tf32 dots, chunked sums; a wrong state is O(1)
    torch.testing.assert_close(state, ref_state, atol=1e-2, rtol=1e-2)
    # with the offsets from the host (the engine's path: no read-back), twice (the cached index): same results
    tensors = case.tensors("cuda")
    for _ in range(2):
        again = before.clone()
        gated_delta_rule(q, k, v, a, b, A_log, dt_bias, again, pending, *args_of(case, "cuda"), replay_only=True)
        out_host = chunk_gated_delta_rule_fla(q, k, v, a, b, A_log, dt_bias, again, pending, *args_of(case, "cuda"),
                                              cu_seqlens_host=tensors[0].cpu().numpy())
        torch.testing.assert_close(out_host, out, atol=1e-5, rtol=1e-5)  # a wrong index is O(1)
        torch.testing.assert_close(again, state, atol=1e-5, rtol=1e-5)
