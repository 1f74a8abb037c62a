"""GPU: greedy outputs of long prompts do not depend on the prefill chunk (issue 38), fp32. Chunks of 256 and 1024
tokens replay prefill graphs (the recurrent GDN kernel); chunks of 2048 run eagerly through the chunked GDN kernel
(fla-core's where it is installed)."""
import pytest

from specdec.models.loader import load_model
from specdec_tools.tiny import make_tiny
from verifier_service.executor import Executor
from verifier_service.plain_generate import greedy_generate

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
CHUNKS = (256, 1024, 2048)
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
        assert (graphs.prefill_tokens[-1] >= chunk) == (chunk <= 1024)   # graphs up to 1024, eager beyond
        outputs[chunk] = greedy_generate(executor, [prompt], NEW_TOKENS, prefill_chunk=chunk)[0]
    assert outputs[256] == outputs[1024] == outputs[2048], outputs
