"""GPU: greedy outputs of long prompts do not depend on the prefill chunk (issue 38), fp32. Chunks of 256 tokens
replay prefill graphs with the recurrent GDN kernel, chunks of 1024 and 2048 prefill graphs with the one-sequence
chunked kernel (fla-core's, carried by the GPU image), and an 8k prompt's first chunk of 5000 (past the largest
prefill graph, 4096) runs that kernel eagerly. Nor on the sequences beside
them: a chunk in a mixed step runs in a chunk lane (specdec/models/forward_batch.py)."""
import pytest

from specdec.models.loader import load_model
from specdec_tools.tiny import make_tiny
from verifier_service.executor import Executor
from verifier_service.plain_generate import greedy_generate

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
CHUNKS = (256, 1024, 2048, 5000)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_tiny(tmp_path_factory.mktemp("small"), preset="small", seed=3, progress=False,
                       overrides={"max_position_embeddings": 16384})
    return load_model(folder, dtype="float32", device="cuda")


@pytest.mark.parametrize("length", [2048, 8192])
def test_greedy_outputs_do_not_depend_on_the_prefill_chunk(model, length):
    import torch
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(1, model.config.vocab_size, (length,), generator=g).tolist()
    outputs = {}
    for chunk in CHUNKS:
        executor = Executor.build(model, num_blocks=length // 16 + 8, block_size=16, max_seqs=1, device="cuda",
                                  max_batched_tokens=max(chunk, 1024))
        graphs = executor.runner.graphs
        assert (graphs.prefill_tokens[-1] >= chunk) == (chunk <= 4096)   # graphs up to 4096, eager beyond
        outputs[chunk] = greedy_generate(executor, [prompt], NEW_TOKENS, prefill_chunk=chunk)[0]
    assert outputs[256] == outputs[1024] == outputs[2048] == outputs[5000], outputs


def test_the_one_sequence_chunked_rule_leaves_its_padding_out():
    """A prefill bucket's GDN call: one sequence of L tokens, then padding rows holding anything (NaN here). Its
    outputs and final state are the reference's over the L tokens alone; the other slots are untouched."""
    import torch

    from kernels.gated_delta_rule import gated_delta_rule_ref
    from kernels.gated_delta_rule.chunk import chunk_gated_delta_rule_one_fla, fla_chunk_kernel
    from specdec.models.caches import pending_ring_rows
    assert fla_chunk_kernel() is not None, "the GPU image carries fla-core (.whl)"
    g = torch.Generator(device="cuda").manual_seed(0)
    T, L, HK, HV, K, V = 1024, 700, 2, 4, 32, 32

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)
    q, k, v, a, b = rand(T, HK, K), rand(T, HK, K), rand(T, HV, V), rand(T, HV), rand(T, HV)
    for x in (q, k, v, a, b):
        x[L:] = float("nan")
    A_log, dt_bias, state = rand(HV) * 0.1, rand(HV) * 0.1, rand(3, HV, K, V) * 0.1
    pending = torch.zeros(3, pending_ring_rows(0), HK * K + HV * (V + 2), device="cuda")
    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")
    ragged = (ints([0, L]), ints([1]), ints([0]), ints([0]))   # cu_seqlens, slots, read offsets, drafts
    positions = torch.arange(T, device="cuda")
    expected_state = state.clone()
    expected = gated_delta_rule_ref(q[:L], k[:L], v[:L], a[:L], b[:L], A_log, dt_bias, expected_state, pending.clone(),
                                    *ragged, positions[:L], L)
    out = chunk_gated_delta_rule_one_fla(q, k, v, a, b, A_log, dt_bias, state, pending, *ragged, positions, T)
    assert torch.allclose(out[:L], expected, atol=5e-3, rtol=5e-3), (out[:L] - expected).abs().max()
    assert torch.allclose(state, expected_state, atol=5e-3, rtol=5e-3), (state - expected_state).abs().max()
    assert torch.equal(state[0], expected_state[0]) and torch.equal(state[2], expected_state[2])


def test_a_prompt_beside_a_decoder_gives_its_outputs_alone(model):
    """A 3000-token prompt in chunks of 1000 beside a 64-token one: the first step (1064 tokens) runs eagerly, the
    next ones (the short prompt decoding beside a chunk) in a mixed bucket's graph, with the long chunk in a chunk
    lane. Greedy outputs equal each prompt's alone."""
    import torch

    from kernels.gated_delta_rule.chunk import fla_chunk_kernel
    assert fla_chunk_kernel() is not None, "the GPU image carries fla-core (.whl): without it there is no lane"
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist() for n in (64, 3000)]

    def run(batch):
        executor = Executor.build(model, num_blocks=512, block_size=16, max_seqs=2, device="cuda",
                                  max_batched_tokens=1024)
        assert executor.runner.graphs.mixed_tokens, "mixed buckets captured"
        return greedy_generate(executor, batch, NEW_TOKENS, prefill_chunk=1000)
    together = run(prompts)
    alone = [run([p])[0] for p in prompts]
    assert together == alone, (together, alone)
