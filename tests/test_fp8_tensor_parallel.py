"""FP8 checkpoints under tensor parallelism (CPU, gloo): each rank reads its slices of every FP8 weight with the scale
blocks that go with them; a weight whose slices start inside a block is read whole and kept dequantized; TP = 2
computes TP = 1's logits and greedy tokens; `--quantization fp8` reaches every rank, which rounds its own slices."""
import pytest
import torch
from test_tensor_parallel import SIZES, _steps

from specdec.models.fp8 import Fp8Format, Fp8Shards, dequantize_blocks, round_through_fp8, scale_shard
from specdec.models.fp8_linear import Fp8Linear
from specdec.models.loader import load_model
from specdec.models.tensor_parallel import Shard, TensorParallel, shard_of, take
from specdec.sampling_params import SamplingParams
from specdec_tools.tiny import make_tiny
from verifier_service.builder import VerifierConfig, build_engine
from verifier_service.executor import Executor
from verifier_service.model_runner import ModelRunner
from verifier_service.rank_group import RankSpec, _build_runner

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 7, 7, 7, 7, 7, 7], [200, 1, 30]]


@pytest.fixture(scope="module", params=[("qwen3_5_moe", "per_expert"), ("qwen3_5_moe", "fused"),
                                        ("qwen3_next", "fused")], ids=["moe-per-expert", "moe-fused", "next"])
def fp8_dir(request, tmp_path_factory):
    """16 x 16 blocks: the tiny shapes' slices are whole blocks at TP 2 (q/k/v, GDN q/k/v, MLP and expert columns)
    except in_proj_a / in_proj_b (2 rows a rank) and the shared expert's (24 columns a rank)."""
    family, layout = request.param
    return make_tiny(tmp_path_factory.mktemp(family), family=family, seed=7, quantization="fp8", fp8_block=16,
                     expert_layout=layout, overrides={"vocab_size": 300}, progress=False)


def test_scale_shard_takes_the_blocks_of_whole_block_slices():
    assert scale_shard(Shard(0, [range(32, 64)]), 2, (16, 8)) == Shard(0, [range(2, 4)])
    assert scale_shard(Shard(1, [range(16, 24)]), 2, (16, 8)) == Shard(1, [range(2, 3)])        # in: block[1]
    assert scale_shard(Shard(1, [range(0, 16), range(32, 48)]), 3, (16, 8)) == Shard(1, [range(0, 1), range(2, 3)])
    assert scale_shard(Shard(2, [range(8, 16)]), 3, (16, 8)) == Shard(2, [range(1, 2)])         # experts' down
    assert scale_shard(Shard(0, [range(32, 40)]), 2, (16, 8)) == Shard(0, [range(2, 3)])        # the edge block
    assert scale_shard(Shard(0, [range(8, 24)]), 2, (16, 8)) is None                            # starts inside
    assert scale_shard(Shard(0, [range(0, 8), range(16, 32)]), 2, (16, 8)) is None              # then misaligned


def test_each_rank_holds_its_slices_of_the_fp8_weights(fp8_dir):
    """Kept in FP8 (the GPU's layout, run here by the kernels' torch reference): every FP8 linear and FP8 expert
    stack of a rank dequantizes exactly to its slices of the full model's weights; the weights read whole are
    its slices, dequantized."""
    full = load_model(fp8_dir)                                   # dequantized, one rank
    weights = full.model.state_dict()
    unquantized = []
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        part = load_model(fp8_dir, tp=tp, fp8_weights=True)
        kinds = {"fp8": 0, "whole": 0, "experts": 0}
        for name, module in part.model.named_modules():
            key = f"{name}.weight"
            if isinstance(module, Fp8Linear):
                got = dequantize_blocks(module.weight, module.weight_scale_inv, module.block, torch.float32)
                kinds["fp8"] += 1
            elif isinstance(module, torch.nn.Linear) and shard_of(full.config, tp, key) is not None \
                    and Fp8Format().converts(key, tuple(module.weight.shape)):
                got = module.weight
                kinds["whole"] += 1
            elif getattr(module, "fp8_block", None) is not None:      # a SparseMoE's routed experts
                for stack in ("experts_gate_up", "experts_down"):
                    got = dequantize_blocks(getattr(module, stack), getattr(module, f"{stack}_scale_inv"),
                                            module.fp8_block, torch.float32)
                    want = take(weights[f"{name}.{stack}"], shard_of(full.config, tp, f"{name}.{stack}"))
                    assert torch.equal(got, want), f"{name}.{stack}"
                kinds["experts"] += 1
                continue
            else:
                continue
            assert torch.equal(got, take(weights[key], shard_of(full.config, tp, key))), key
        assert kinds["fp8"] >= 4 and kinds["experts"] == full.config.num_hidden_layers, kinds
        unquantized.append(kinds["whole"])
    # rank 0's slices start on a block (in_proj_a's 2 rows: a partial one), rank 1's of in_proj_a / _b and of the
    # shared expert inside one (Qwen3-Next's fused in_proj_qkvz / in_proj_ba are dequantized on every rank)
    assert unquantized[1] >= unquantized[0] + 2 * full.config.num_hidden_layers, unquantized


def test_a_slice_inside_a_block_is_read_whole_and_dequantized(fp8_dir):
    config = load_model(fp8_dir).config
    shards = Fp8Shards(lambda name: shard_of(config, TensorParallel(1, 2), name), Fp8Format((16, 16)))
    assert shards("layers.0.linear_attn.in_proj_a.weight") is None                  # 2 of 4 rows: inside a block
    assert shards("layers.0.linear_attn.in_proj_a.weight_scale_inv") is None
    assert "layers.0.linear_attn.in_proj_a.weight" in shards.whole
    assert shards("layers.3.self_attn.o_proj.weight_scale_inv") == Shard(1, [range(2, 4)])   # 32 columns of 64
    assert shards("layers.0.input_layernorm.weight") is None and len(shards.whole) == 1     # replicated


def test_two_ranks_on_an_fp8_checkpoint_compute_the_logits_of_one(fp8_dir):
    one = Executor(ModelRunner(load_model(fp8_dir), **SIZES))
    two = Executor.build_parallel(RankSpec(str(fp8_dir), 2, runner=SIZES))
    try:
        for (h1, l1), (h2, l2) in zip(_steps(one), _steps(two)):
            assert (l2 - l1).abs().max().item() <= 1e-5 * l1.abs().max().item()
            assert (h2 - h1).abs().max().item() <= 1e-5 * h1.abs().max().item()
    finally:
        two.close()


def test_quantization_fp8_reaches_every_rank_which_rounds_its_own_slices(tmp_path, monkeypatch):
    """`--quantization fp8` under tensor parallelism: the builder hands it to the ranks, and a rank holds its slices
    of the bf16 checkpoint rounded through 128 x 128 blocks of their own."""
    bf16 = make_tiny(tmp_path / "bf16", family="qwen3_5", seed=2, progress=False)
    specs = []
    monkeypatch.setattr(Executor, "build_parallel", lambda spec, prefix=None: specs.append(spec) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        build_engine(VerifierConfig(str(bf16), tensor_parallel_size=2, num_drafts=0, warm_up=False,
                                    quantization="fp8"))
    assert specs[0].quantization == "fp8"
    full = load_model(bf16).model.state_dict()
    tp = TensorParallel(1, 2)
    runner = _build_runner(specs[0], tp)
    mine = runner.model.state_dict()
    want = round_through_fp8({k: take(v, shard_of(runner.model.full_config, tp, k)) for k, v in full.items()
                              if k in mine}, Fp8Format())
    rounded = [k for k in mine if not torch.equal(want[k], take(full[k], shard_of(runner.model.full_config, tp, k)))]
    assert len(rounded) >= 8
    for k in mine:
        assert torch.equal(mine[k], want[k]), k


def test_greedy_tokens_of_two_ranks_equal_one_on_an_fp8_checkpoint(fp8_dir):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = dict(model_dir=str(fp8_dir), num_drafts=0, max_context=128, max_running=4, max_batched_tokens=64,
                  prefill_chunk=16, warm_up=False)
    want = build_engine(VerifierConfig(**config)).generate(PROMPTS, params)
    engine = build_engine(VerifierConfig(**config, tensor_parallel_size=2))
    try:
        assert engine.generate(PROMPTS, params) == want
    finally:
        engine.executor.close()
