"""Counter-based randomness (kernels/sampling/philox.py): the properties lossless sampling rests on.

Each property is a check function applied to our implementation and to a planted copy of a defect it must
catch (the two defects of the sampling issue: acceptance uniforms aliased with token draws by a masked index,
and uniforms that round to exactly 1.0).
"""
import pytest
import torch
from sampling_stats import ks_uniform_p_value

from kernels.sampling import ACCEPT, DRAW, RECOVER, bits_to_uniform, exponential_race, philox4x32, uniforms

# ---- planted defects: the sampler as it was -----------------------------------------------------------------
_MASK32 = 0xFFFFFFFF


def _old_hash32(x):
    def mul32(x, c):
        lo, hi = c & 0xFFFF, c >> 16
        return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32
    x = x & _MASK32
    x = mul32(x ^ (x >> 16), 0x7FEB352D)
    x = mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def _old_bits(seeds, positions, index):
    key = _old_hash32(_old_hash32(seeds & _MASK32) ^ _old_hash32((seeds >> 32) ^ _MASK32) ^ positions)
    return _old_hash32(key[:, None] ^ _old_hash32(index + 0x9E3779B9))


def old_uniforms(seeds, positions, stream, index):
    """Defect 1: the stream lived in the index (ACCEPT_STREAM = 1 << 40), which the hash masked to 32 bits."""
    index = torch.as_tensor(index)
    index = index[None, :] if index.dim() == 1 else index
    return (_old_bits(seeds, positions, index + (stream << 40)).float() + 0.5) / 4294967296.0


def old_bits_to_uniform(bits):
    """Defect 2: float32 rounds (bits + 0.5) / 2^32 up to exactly 1.0 for bits >= 2^32 − 128."""
    return (bits.float() + 0.5) / 4294967296.0


def old_race(log_probs, seeds, positions, stream):
    """The old race: p / −log u with no guard, so u = 1 gives 0 / 0 = NaN, which argmax picks."""
    probs = log_probs.exp()
    bits = torch.full((probs.shape[0], probs.shape[1]), 0xFFFFFFFF, dtype=torch.long)
    return (probs / -torch.log(old_bits_to_uniform(bits))).argmax(-1)


# ---- checks -------------------------------------------------------------------------------------------------
EXTREME_BITS = torch.tensor([0, 1, 2, 255, 256, 2 ** 31, 2 ** 32 - 2 ** 9, 2 ** 32 - 129, 2 ** 32 - 128,
                             2 ** 32 - 2, 2 ** 32 - 1])


def check_open_interval(to_uniform):
    u = to_uniform(EXTREME_BITS)
    assert bool((u > 0).all()) and bool((u < 1).all()), u.tolist()
    assert bool((-torch.log(u) > 0).all())


def check_streams_independent(uniform_fn, n=20000):
    seeds = torch.arange(n, dtype=torch.long) * 0x9E3779B97F4A7C15 % (2 ** 63)
    positions = torch.arange(n, dtype=torch.long) % 97
    accept = uniform_fn(seeds, positions, ACCEPT, torch.zeros(1, dtype=torch.long))[:, 0]       # [n]
    for stream in (DRAW, RECOVER):
        draws = uniform_fn(seeds, positions, stream, torch.arange(8))                             # [n, 8]
        for v in range(8):
            assert (accept == draws[:, v]).float().mean().item() < 1e-3, (stream, v)
            corr = torch.corrcoef(torch.stack([accept, draws[:, v]]).double())[0, 1].item()
            assert abs(corr) < 5 / n ** 0.5, (stream, v, corr)


def check_zero_probability_never_wins(race):
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 1.0]])
    chosen = race(probs.log(), torch.tensor([1, 2]), torch.tensor([0, 0]), DRAW)
    assert bool((probs.gather(-1, chosen[:, None]) > 0).all()), chosen.tolist()


# ---- tests --------------------------------------------------------------------------------------------------
def test_philox_known_answers():
    """Philox4x32-10 known-answer vectors of Random123 (Salmon et al.), which the Triton kernel matches too."""
    def words(*xs):
        return [torch.tensor([x]) for x in xs]
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((_MASK32,) * 4, (_MASK32, _MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in cases:
        assert [int(w) for w in philox4x32(*words(*counter), *words(*key))] == list(want)


def test_uniforms_strictly_inside_the_unit_interval():
    check_open_interval(bits_to_uniform)
    assert bits_to_uniform(torch.tensor([2 ** 32 - 1])).item() == 1 - 2 ** -24
    assert bits_to_uniform(torch.tensor([0])).item() == 2 ** -24


def test_open_interval_check_catches_rounding_to_one():
    with pytest.raises(AssertionError):
        check_open_interval(old_bits_to_uniform)


def test_streams_are_independent():
    check_streams_independent(uniforms)


def test_stream_check_catches_the_masked_index():
    with pytest.raises(AssertionError):
        check_streams_independent(old_uniforms)


def test_zero_probability_tokens_never_win_the_race():
    check_zero_probability_never_wins(exponential_race)


def test_zero_probability_check_catches_the_unguarded_race():
    with pytest.raises(AssertionError):
        check_zero_probability_never_wins(old_race)


def test_every_field_of_the_key_matters_and_none_aliases():
    """Swapping index and position, or position and stream, or the seed's halves, gives other numbers."""
    seed, lo, hi = torch.tensor([5 + (7 << 32)]), torch.tensor([7 + (5 << 32)]), torch.tensor([0])
    base = uniforms(seed, torch.tensor([3]), DRAW, torch.tensor([11]))
    assert base.item() != uniforms(seed, torch.tensor([11]), DRAW, torch.tensor([3])).item()
    assert base.item() != uniforms(seed, torch.tensor([DRAW]), 3, torch.tensor([11])).item()
    assert base.item() != uniforms(lo, torch.tensor([3]), DRAW, torch.tensor([11])).item()
    assert base.item() != uniforms(hi, torch.tensor([3]), DRAW, torch.tensor([11])).item()


def test_a_rows_numbers_do_not_depend_on_its_batch():
    seeds = torch.tensor([3, 99, 2 ** 62 + 1, 7])
    positions = torch.tensor([0, 5, 9, 1])
    together = uniforms(seeds, positions, DRAW, torch.arange(50))
    for r in range(4):
        alone = uniforms(seeds[r:r + 1], positions[r:r + 1], DRAW, torch.arange(50))
        assert torch.equal(alone[0], together[r])


def test_uniforms_are_uniform():
    u = uniforms(torch.arange(200), torch.arange(200) % 13, DRAW, torch.arange(1000)).flatten()
    _, p = ks_uniform_p_value(u[:100000])
    assert p > 1e-6
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / u.numel()) ** 0.5
