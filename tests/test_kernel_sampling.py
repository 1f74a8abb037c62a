"""The Triton exponential race against its torch reference: the same token on every row (CPU: TRITON_INTERPRET)."""
import pytest
import torch

from kernels.sampling import DRAW, RECOVER, exponential_race_ref

triton_race = pytest.importorskip("kernels.sampling.race_triton").exponential_race_triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(rows, vocab, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[0, ::3] = float("-inf")                       # cut tokens
    logits[-1, :] = float("-inf")
    logits[-1, vocab - 1] = 0.0                          # only the last token left (the end of the last split)
    seeds = torch.randint(0, 2 ** 62, (rows,), generator=g)
    positions = torch.randint(0, 2 ** 32, (rows,), generator=g)
    return logits.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE)


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 1000), (4, 8192), (2, 8193), (5, 20011)])
@pytest.mark.parametrize("stream", [DRAW, RECOVER])
def test_race_kernel_equals_reference(rows, vocab, stream):
    logits, seeds, positions = case(rows, vocab, seed=vocab)
    got = triton_race(logits, seeds, positions, stream)
    assert torch.equal(got, exponential_race_ref(logits, seeds, positions, stream))
    assert got[-1].item() == vocab - 1
    assert bool(torch.isfinite(logits.gather(1, got[:, None])).all())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 64, 256])
def test_race_kernel_at_the_4b_vocabulary(rows):
    if not torch.cuda.is_available():
        pytest.fail("GPU test: run it on the GPU machine (CI deselects -m gpu)")
    logits, seeds, positions = case(rows, 248320, dtype=torch.bfloat16)
    assert torch.equal(triton_race(logits, seeds, positions, DRAW),
                       exponential_race_ref(logits.float(), seeds, positions, DRAW))
