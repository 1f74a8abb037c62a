"""Paged attention and write_kv: the Triton kernels against the torch reference.

CPU: the Triton path runs under TRITON_INTERPRET=1 (set before the kernel modules are first imported) on small,
awkward shapes. GPU (`-m gpu`): the same checks at the Qwen3.5-4B attention shape through the public entry points.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.paged_attention import paged_attention, paged_attention_ref, write_kv, write_kv_ref  # noqa: E402

triton_attention = pytest.importorskip("kernels.paged_attention.triton_paged_attention")
triton_write_kv = pytest.importorskip("kernels.paged_attention.triton_write_kv")


def make_case(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, device="cpu",
              pad_tokens=0, seed=0):
    """seqs: (cached tokens before this step, query tokens this step) per sequence; (0, 0) is graph padding.
    Blocks are shuffled over a cache larger than needed; `pad_tokens` trailing rows belong to no sequence."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-(c + n) // block_size) for c, n in seqs]
    width = max(max(widths), 1)
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    cu, positions, used = [0], [], 0
    for b, ((cached, n), w) in enumerate(zip(seqs, widths)):
        tables[b, :w] = torch.tensor(perm[used:used + w], dtype=torch.int32)
        used += w
        positions += range(cached, cached + n)
        cu.append(cu[-1] + n)
    num_tokens = cu[-1] + pad_tokens
    positions += [0] * pad_tokens
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    dev = lambda t: t.to(device)  # noqa: E731
    return dict(q=dev(q), k_cache=dev(k_cache), v_cache=dev(v_cache),
                positions=dev(torch.tensor(positions, dtype=torch.int64)), block_tables=dev(tables),
                cu_seqlens=dev(torch.tensor(cu, dtype=torch.int32)),
                max_seqlen=max(n for _, n in seqs), scale=head_dim ** -0.5), cu[-1]


def check_attention(case, real_tokens, run, atol):
    want = paged_attention_ref(**case)
    out = torch.full_like(case["q"], float("nan"))
    got = run(**case, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not got[:real_tokens].isnan().any(), "a query row was not written"
    assert got[real_tokens:].isnan().all(), "a row that belongs to no sequence was written"
    err = (got[:real_tokens].float() - want[:real_tokens].float()).abs().max().item()
    assert err <= atol, err


# (cached before the step, query tokens): decode, verify with k = 0..4, chunked prefill, 0-length padding
VERIFY = [(5, 1), (16, 2), (0, 3), (0, 0), (30, 4), (7, 5), (0, 0)]
PREFILL = [(0, 37), (19, 23), (0, 0), (3, 1)]
DECODE = [(1, 1), (0, 1), (40, 1), (0, 0), (9, 1)]
SHAPES = {  # num_heads, num_kv_heads, head_dim, block_size
    "gqa4-d24-bs4": (8, 2, 24, 4),
    "gqa3-d40-bs5": (6, 2, 40, 5),
    "mha-d16-bs16": (3, 3, 16, 16),
}


@pytest.mark.parametrize("seqs", [VERIFY, PREFILL, DECODE], ids=["verify", "prefill", "decode"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_matches_reference(seqs, shape, num_splits):
    case, real = make_case(seqs, *SHAPES[shape], pad_tokens=3, seed=len(seqs) + num_splits)
    check_attention(case, real, lambda **kw: triton_attention.paged_attention_triton(**kw, num_splits=num_splits),
                    atol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_a_chunk_beside_decoders_in_a_padded_bucket_matches_reference(num_splits):
    """A graph bucket's step: one prompt chunk among decoders and padding sequences of no tokens, max_seqlen the
    bucket's (larger than the chunk), trailing rows of no sequence. The flat query tiles find each sequence's rows
    from cu_seqlens; the tiles past the last one write nothing."""
    seqs = [(9, 1), (0, 1), (2, 29), (40, 1), (0, 0), (0, 0)]
    case, real = make_case(seqs, 8, 2, 24, 4, pad_tokens=11, seed=3)
    case["max_seqlen"] = 64
    cfg = triton_attention.launch_config(len(seqs), 64, 8, 2, 24, case["q"].device, num_splits,
                                         num_tokens=case["q"].shape[0])
    assert cfg["num_q_tiles"] == -(-case["q"].shape[0] // cfg["BLOCK_M"]) + len(seqs) < len(seqs) * 64 // cfg["BLOCK_M"]
    check_attention(case, real, lambda **kw: triton_attention.paged_attention_triton(**kw, num_splits=num_splits),
                    atol=2e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_query_tiles_spanning_several_key_tiles_mask_only_their_own_future(num_splits):
    """Tiles of 32 query tokens over key tiles of 8: a tile's keys below its first row's position skip the causal
    mask, the rest keep it. Rows later in a tile must not let earlier rows see their keys (a leak there passes
    the shapes above, whose query tiles span at most one key tile)."""
    seqs = [(0, 70), (13, 40), (0, 0), (5, 1)]
    case, real = make_case(seqs, 4, 4, 16, 4, pad_tokens=2, seed=5)
    tuning = dict(rows=32, block_n=8)
    cfg = triton_attention.launch_config(len(seqs), 70, 4, 4, 16, case["q"].device, num_splits, tuning)
    assert cfg["BLOCK_M"] == 32 and cfg["BLOCK_N"] == 8
    check_attention(case, real, lambda **kw: triton_attention.paged_attention_triton(
        **kw, num_splits=num_splits, tuning=tuning), atol=2e-5)


def test_chunks_deep_into_a_prompt_take_128_row_query_tiles():
    """At the 4B shape (16 q / 4 kv heads of 256, bf16 cache, an H100's shared memory): a prompt chunk takes query
    tiles of 128 rows (32 tokens x 4 heads) and 8 warps from wide_tile_context(its length) tokens of context:
    2048 for chunks of 2048, 8192 for 1024, 16384 for 512, never for shorter ones. Nearer the start, or over an
    fp32 cache (whose 128-row tiles would not fit), 64 rows. Decode and verify tiles stay as they are."""
    from kernels.paged_attention import wide_tile_context
    assert [wide_tile_context(n) for n in (4096, 2048, 1500, 1024, 512, 511, 1)] == \
        [2048, 2048, 8192, 8192, 16384, None, None]

    def rows(max_seqlen, min_context, kv_bytes=2):
        return triton_attention.launch_config(1, max_seqlen, 16, 4, 256, torch.device("cpu"), kv_bytes=kv_bytes,
                                              min_context=min_context)["ROWS"]
    deep = triton_attention.launch_config(1, 2048, 16, 4, 256, torch.device("cpu"), min_context=2048)
    assert (deep["ROWS"], deep["BLOCK_M"], deep["BLOCK_N"], deep["num_warps"]) == (128, 32, 64, 8)
    assert rows(1024, 8192) == rows(512, 16384) == 128
    assert rows(2048, 2047) == rows(1024, 8191) == rows(512, 16383) == rows(256, 10 ** 6) == 64
    assert rows(2048, 2048, kv_bytes=4) == 64
    assert rows(1, 10 ** 6) == rows(1, 0) and rows(4, 10 ** 6) == rows(4, 0)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_wide_query_tiles_give_the_reference(num_splits):
    """The tiles `min_context` picks change the work split, never the result: a 520-token chunk (and a short one
    and a decoder beside it) through 128-row tiles, against the reference. (min_context is a bound the caller
    promises; the kernel reads no key by it, so an overstated one still gives exact results here.)"""
    seqs = [(40, 520), (2050, 9), (2300, 1), (0, 0)]
    case, real = make_case(seqs, 8, 2, 16, 16, pad_tokens=3, seed=7)
    assert triton_attention.launch_config(3, 520, 8, 2, 16, case["q"].device, min_context=10 ** 6)["ROWS"] == 128
    check_attention(case, real, lambda **kw: triton_attention.paged_attention_triton(
        **kw, num_splits=num_splits, min_context=10 ** 6), atol=2e-5)


def test_splits_aim_at_four_programs_per_sm_for_a_chunk_beside_decoders(monkeypatch):
    """At the 4B shape on 132 SMs: a 512-token chunk beside 15 decoders in the 576-token mixed graph (tiles of 16
    tokens: 36 + 16 flat tiles x 4 kv heads) splits its keys 4 ways, as a 512-token chunk alone does (2 programs per
    SM); a 1024-token chunk alone 2 ways; decode at 16 sequences 8 ways (unchanged)."""
    monkeypatch.setattr(triton_attention, "_num_sms", lambda device: 132)

    def splits(num_seqs, max_seqlen, num_tokens):
        return triton_attention.launch_config(num_seqs, max_seqlen, 16, 4, 256, torch.device("cpu"),
                                              num_tokens=num_tokens)["NUM_SPLITS"]
    assert splits(16, 1024, 576) == 4 and splits(1, 512, 512) == 4
    assert splits(1, 1024, 1024) == 2 and splits(16, 1, 16) == 8


def test_default_launch_splits_and_half_precision():
    """The launcher's own split choice (several splits on the interpreter's 8 'SMs') in fp16. (The interpreter's
    tl.dot reads bf16 operands as integers, so bf16 is checked by the GPU tests only.)"""
    case, real = make_case(VERIFY[:3], 8, 2, 24, 4, dtype=torch.float16, pad_tokens=2, seed=11)
    assert triton_attention.launch_config(3, case["max_seqlen"], 8, 2, 24, case["q"].device)["NUM_SPLITS"] > 1
    check_attention(case, real, triton_attention.paged_attention_triton, atol=2e-2)


def test_prompt_chunks_take_64_key_tiles_at_head_dim_256():
    """The launch rule at the 4B shape (16 q / 4 kv heads of 256): a prompt chunk's 64-row tiles take 64 keys from
    a 16-bit cache; decode and verify tiles, fp32 caches and a GPU of less shared memory than an H100's (an A100's
    163 KiB: their tiles would not fit), 32."""
    def block_n(max_seqlen, kv_bytes=2):
        return triton_attention.launch_config(1, max_seqlen, 16, 4, 256, torch.device("cpu"),
                                              kv_bytes=kv_bytes)["BLOCK_N"]
    assert block_n(1024) == block_n(16) == 64
    assert block_n(1) == block_n(4) == block_n(1024, kv_bytes=4) == 32
    triton_attention._shared_memory.cache_clear()
    real = triton_attention._shared_memory
    try:
        triton_attention._shared_memory = lambda device: 163 * 1024
        assert block_n(1024) == 32
    finally:
        triton_attention._shared_memory = real


def test_reference_matches_dense_causal_attention():
    """The reference itself against plain SDPA over contiguous keys (no paging, no GQA tricks)."""
    seqs = [(5, 3), (0, 4)]
    case, real = make_case(seqs, 4, 2, 16, 4, seed=5)
    out = paged_attention_ref(**case)
    flat_k = case["k_cache"].flatten(0, 1)
    flat_v = case["v_cache"].flatten(0, 1)
    start = 0
    for b, (cached, n) in enumerate(seqs):
        length = cached + n
        rows = torch.arange(length)
        slots = case["block_tables"][b, rows // 4].long() * 4 + rows % 4
        keys = flat_k[slots].repeat_interleave(2, dim=1).transpose(0, 1)      # [NH, L, D]
        values = flat_v[slots].repeat_interleave(2, dim=1).transpose(0, 1)
        queries = case["q"][start:start + n].transpose(0, 1)                 # [NH, n, D]
        mask = rows[None, :] <= torch.arange(cached, length)[:, None]         # [n, L]
        dense = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        assert torch.allclose(out[start:start + n], dense.transpose(0, 1), atol=1e-5)
        start += n


def test_triton_fails_on_a_planted_off_by_one():
    """The parity check is sharp: attending to one key too few (positions − 1) is caught."""
    case, real = make_case(VERIFY, 8, 2, 24, 4, pad_tokens=1, seed=2)
    planted = dict(case, positions=case["positions"] - 1)
    with pytest.raises(AssertionError):
        check_attention(case, real, lambda **kw: triton_attention.paged_attention_triton(
            **dict(kw, positions=planted["positions"])), atol=2e-5)


@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 24), (3, 40), (1, 16)])
def test_write_kv_triton_matches_reference(num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    k = torch.randn(7, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(7, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(6 * 5, generator=gen)[:7]
    caches = [torch.full((6, 5, num_kv_heads, head_dim), float("nan")) for _ in range(4)]
    write_kv_ref(k, v, caches[0], caches[1], slots)
    triton_write_kv.write_kv_triton(k, v, caches[2], caches[3], slots)
    for want, got in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(want.isnan(), got.isnan()), "a row outside slot_mapping was written"
        assert torch.equal(want.nan_to_num(), got.nan_to_num())
    assert caches[2].isnan().sum() == (30 - 7) * num_kv_heads * head_dim


def test_public_entry_points_dispatch_to_reference_on_cpu():
    case, real = make_case(PREFILL, 8, 2, 24, 4, seed=3)
    assert torch.equal(paged_attention(**case), paged_attention_ref(**case))
    k = torch.randn(2, 2, 24)
    cache = [torch.zeros(3, 4, 2, 24) for _ in range(2)]
    write_kv(k, k, *cache, torch.tensor([5, 0]))
    assert torch.equal(cache[0].flatten(0, 1)[5], k[0]) and torch.equal(cache[1].flatten(0, 1)[0], k[1])


# ---- GPU, Qwen3.5-4B attention shape: 16 q heads / 4 kv heads × 256, block 16, bf16 -------------------------
GPU_CASES = {
    "decode-b8-ctx2048": [(2047, 1)] * 8,
    "verify-k3-b1-ctx128": [(124, 4)],
    "verify-k3-b64-ctx2048": [(2044, 4)] * 63 + [(0, 0)],
    "verify-ragged-k0to4": [(100 + 37 * i, i % 5 + 1) for i in range(20)] + [(0, 0)] * 4,
    "prefill-2048": [(0, 2048)],
    "prefill-chunk-after-1000": [(1000, 512), (0, 0)],
    "prefill-chunk-after-6144": [(6144, 2048)],                    # 128-row query tiles (min_context)
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES), ids=list(GPU_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_4b_shape(name, dtype, cuda):
    case, real = make_case(GPU_CASES[name], 16, 4, 256, 16, dtype=dtype, device="cuda", pad_tokens=5, seed=1)
    least = min(c for c, n in GPU_CASES[name] if n)
    check_attention(case, real, lambda **kw: paged_attention(**kw, min_context=least),
                    atol=2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
def test_gpu_write_kv_4b_shape(cuda):
    k, v = (torch.randn(300, 4, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    caches = [torch.zeros(64, 16, 4, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    write_kv_ref(k, v, caches[0], caches[1], slots)
    write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.gpu
def test_gpu_verify_replays_in_a_cuda_graph_with_new_lengths(cuda):
    """One graph for a (batch 8, k+1 = 4) bucket: replayed with other contexts, shorter drafts and padding
    sequences written into the same buffers, it equals the reference; no host sync inside."""
    first, _ = make_case([(400 + 50 * i, 4) for i in range(8)], 16, 4, 256, 16, dtype=torch.bfloat16,
                         device="cuda", seed=2)
    static = {k: v.clone() if torch.is_tensor(v) else v for k, v in first.items()}
    paged_attention(**static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = paged_attention(**static)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    seqs = [(700, 4), (12, 1), (0, 0), (299, 3), (5, 2), (0, 0), (640, 4), (0, 0)]
    second, real = make_case(seqs, 16, 4, 256, 16, dtype=torch.bfloat16, device="cuda", seed=3)
    assert second["k_cache"].shape[0] <= static["k_cache"].shape[0] and real <= static["q"].shape[0]
    assert second["block_tables"].shape[1] <= static["block_tables"].shape[1]
    static["q"][:real] = second["q"]
    static["k_cache"][:second["k_cache"].shape[0]] = second["k_cache"]
    static["v_cache"][:second["v_cache"].shape[0]] = second["v_cache"]
    static["positions"][:real] = second["positions"]
    static["cu_seqlens"].copy_(second["cu_seqlens"])
    static["block_tables"].zero_()
    static["block_tables"][:, :second["block_tables"].shape[1]] = second["block_tables"]
    graph.replay()
    want = paged_attention_ref(**static)
    assert (out[:real].float() - want[:real].float()).abs().max().item() <= 2e-2
