"""The prefix cache's namespaces (`cache_salt`, as vLLM's): a request resumes only from prefixes cached by requests
of the same salt, so tenants that must not learn of each other's prompts (through `cached_tokens` or the time to
the first token) do not share them. Outputs do not depend on the salt."""
import pytest
from engine_factory import BLOCK, make_engine, random_prompts

from specdec.prefix_cache import ROOT_HASH, chain_hashes, root_hash
from specdec.rpc.sampling_codec import params_from_proto, params_to_proto
from specdec.sampling_params import SamplingError, SamplingParams
from verifier_service.block_manager import PrefixCaching

CACHE = PrefixCaching(checkpoint_interval=4 * BLOCK, num_checkpoints=16)


def test_a_salt_renames_every_block():
    tokens = list(range(3, 23))
    plain, salted = chain_hashes(tokens, 4, 5), chain_hashes(tokens, 4, 5, root=root_hash("a"))
    assert root_hash(None) == root_hash("") == ROOT_HASH and plain == chain_hashes(tokens, 4, 5, root=ROOT_HASH)
    assert not set(plain) & set(salted)
    assert salted == chain_hashes(tokens, 4, 5, root=root_hash("a")) != chain_hashes(tokens, 4, 5, root=root_hash("b"))


def test_prefixes_are_shared_only_under_the_same_salt(tiny_model):
    vocab = tiny_model.config.vocab_size
    prompt = random_prompts([30], vocab, seed=21)[0]
    engine = make_engine(tiny_model, chunk=8, prefix=CACHE)

    def run(salt):
        params = SamplingParams(max_tokens=5, ignore_eos=True, cache_salt=salt)
        engine.add_request(f"r{len(seen)}", prompt, params)
        tokens, cached = [], 0
        while engine.has_work:
            for o in engine.step():
                tokens += o.new_token_ids
                cached = o.cached_tokens
        seen.append((salt, cached))
        return tokens
    seen = []
    outputs = [run(salt) for salt in (None, "a", "a", "b", None, "b")]
    assert all(t == outputs[0] for t in outputs)
    whole = (30 // BLOCK) * BLOCK - 1            # a repeat resumes one token short of its last whole block
    assert seen == [(None, 0), ("a", 0), ("a", whole), ("b", 0), (None, whole), ("b", whole)]


@pytest.mark.parametrize("salt", ["", "x" * 257, 7])
def test_a_bad_salt_is_refused_by_name(salt):
    with pytest.raises(SamplingError, match="cache_salt"):
        SamplingParams(cache_salt=salt).validate()


def test_the_salt_crosses_the_wire():
    params = SamplingParams(max_tokens=3, cache_salt="tenant")
    assert params_from_proto(params_to_proto(params)).cache_salt == "tenant"
    assert params_from_proto(params_to_proto(SamplingParams(max_tokens=3))).cache_salt is None
