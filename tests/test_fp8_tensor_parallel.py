"""FP8 checkpoints under tensor parallelism (CPU, gloo): each rank reads its slices of every FP8 weight with the scale
blocks that go with them; a weight whose slices do not line up with the blocks is read widened to them and kept
dequantized; TP = 2
computes TP = 1's logits and greedy tokens; `--quantization fp8` reaches every rank, which rounds its own slices."""
import pytest
import torch
from test_tensor_parallel import SIZES, _steps

from specdec.models.fp8 import SCALE_SUFFIX, Fp8Format, Fp8Shards, dequantize_blocks, round_through_fp8, scale_shard
from specdec.models.fp8_linear import Fp8Linear
from specdec.models.loader import fp8_format, load_model
from specdec.models.tensor_parallel import Shard, TensorParallel, shard_of, take
from specdec.sampling_params import SamplingParams
from specdec_tools.tiny import make_tiny
from verifier_service.builder import VerifierConfig, build_engine
from verifier_service.executor import Executor
from verifier_service.model_runner import ModelRunner
from verifier_service.rank_group import RankSpec, _build_runner

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 7, 7, 7, 7, 7, 7], [200, 1, 30]]


@pytest.fixture(scope="module", params=[("qwen3_5_moe", "per_expert", (16, 16)), ("qwen3_5_moe", "fused", (16, 8)),
                                        ("qwen3_5_moe", "fused", (128, 128)), ("qwen3_next", "fused", (16, 16))],
                ids=["moe-per-expert", "moe-fused", "moe-fused-128", "next"])
def fp8_dir(request, tmp_path_factory):
    """Blocks of 16 rows: at TP 2 the tiny shapes' slices are whole blocks (q/k/v, GDN q/k/v, MLP and expert
    columns), in_proj_a / in_proj_b's 2 rows a rank lie inside one, and rank 1's 24 shared-expert columns (24..47)
    do not line up. Blocks of 16 x 8 tell the two sides apart (the experts' down splits its 8-wide side). Qwen's
    128 x 128: nearly nothing lines up, and the experts' gate rows widened to a block run past the stack's 64 rows
    (the up rows read after them must still land where they belong)."""
    family, layout, block = request.param
    return make_tiny(tmp_path_factory.mktemp(family), family=family, seed=7, quantization="fp8", fp8_block=block,
                     expert_layout=layout, overrides={"vocab_size": 301}, progress=False)


def test_scale_shard_takes_the_blocks_of_whole_block_slices():
    assert scale_shard(Shard(0, [range(32, 64)]), 2, (16, 8)) == Shard(0, [range(2, 4)])
    assert scale_shard(Shard(1, [range(16, 24)]), 2, (16, 8)) == Shard(1, [range(2, 3)])        # in: block[1]
    assert scale_shard(Shard(1, [range(0, 16), range(32, 48)]), 3, (16, 8)) == Shard(1, [range(0, 1), range(2, 3)])
    assert scale_shard(Shard(2, [range(8, 16)]), 3, (16, 8)) == Shard(2, [range(1, 2)])         # experts' down
    assert scale_shard(Shard(0, [range(32, 40)]), 2, (16, 8)) == Shard(0, [range(2, 3)])        # the edge block
    assert scale_shard(Shard(0, [range(8, 24)]), 2, (16, 8)) is None                            # across blocks
    assert scale_shard(Shard(0, [range(18, 30)]), 2, (16, 8)) == Shard(0, [range(1, 2)])        # inside one
    assert scale_shard(Shard(0, [range(0, 8), range(16, 32)]), 2, (16, 8)) is None              # then misaligned
    assert scale_shard(Shard(0, [range(0, 16), range(18, 30)]), 2, (16, 8)) == Shard(0, [range(0, 1), range(1, 2)])


def test_each_rank_holds_its_slices_of_the_fp8_weights(fp8_dir):
    """Kept in FP8 (the GPU's layout, run here by the kernels' torch reference): every FP8 linear and FP8 expert
    stack of a rank dequantizes exactly to its slices of the full model's weights; the weights read widened are
    its slices, dequantized."""
    full = load_model(fp8_dir)                                   # dequantized, one rank
    weights = full.model.state_dict()
    unquantized = []
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        part = load_model(fp8_dir, tp=tp, fp8_weights=True)
        kinds = {"fp8": 0, "widened": 0, "experts": 0}
        for name, module in part.model.named_modules():
            key = f"{name}.weight"
            if isinstance(module, Fp8Linear):
                got = dequantize_blocks(module.weight, module.weight_scale_inv, module.block, torch.float32)
                kinds["fp8"] += 1
            elif isinstance(module, torch.nn.Linear) and shard_of(full.config, tp, key) is not None \
                    and Fp8Format().converts(key, tuple(module.weight.shape)):   # read widened (or next's fused)
                got = module.weight
                kinds["widened"] += 1
            elif hasattr(module, "experts_gate_up"):                 # a SparseMoE's routed experts
                for stack in ("experts_gate_up", "experts_down"):
                    got = getattr(module, stack)
                    if module.fp8_block is not None:
                        got = dequantize_blocks(got, getattr(module, f"{stack}_scale_inv"), module.fp8_block,
                                                torch.float32)
                    want = take(weights[f"{name}.{stack}"], shard_of(full.config, tp, f"{name}.{stack}"))
                    assert torch.equal(got, want), f"{name}.{stack}"
                kinds["experts"] += 1
                continue
            else:
                continue
            assert torch.equal(got, take(weights[key], shard_of(full.config, tp, key))), key
        assert kinds["fp8"] >= 4 and kinds["experts"] == full.config.num_hidden_layers, kinds
        unquantized.append(kinds["widened"])
    if fp8_format(fp8_dir).block[0] == 16:
        # rank 1's shared-expert gate and up rows (and, in 16-column blocks, its down columns) do not line up with
        # the blocks (Qwen3-Next's fused in_proj_qkvz / in_proj_ba are dequantized on every rank)
        assert unquantized[1] >= unquantized[0] + 2 * full.config.num_hidden_layers, unquantized


def test_slices_that_do_not_line_up_are_read_widened_dequantized_and_cut():
    """Rows 24..47 of a [48, 64] weight in 16-row blocks: read as rows 16..47 with scale rows 1..2, dequantized,
    cut back to 24..47; two slices (8..23 and 40..55 of 64 rows) alike. A slice inside one block keeps its bytes."""
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(64, 32, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(4, 4, generator=g) + 0.5                       # [64 / 16, 32 / 8]
    whole = dequantize_blocks(full, scale_inv, (16, 8), torch.float32)
    for rows in ([range(24, 48)], [range(8, 24), range(40, 56)]):
        shard = Shard(0, rows)
        shards = Fp8Shards(lambda name: shard, (16, 8), {"w": 2})
        read_w, read_s = shards("w"), shards("w" + SCALE_SUFFIX)
        assert all(r.start % 16 == 0 for r in read_w.rows) and shards.widened == {"w": (shard, read_w)}
        tensors = shards.finish({"w": take(full, read_w), "w" + SCALE_SUFFIX: take(scale_inv, read_s)}, torch.float32)
        assert list(tensors) == ["w"] and torch.equal(tensors["w"], take(whole, shard))
    inside = Fp8Shards(lambda name: Shard(0, [range(2, 4)]), (16, 8), {"w": 2})
    assert inside("w") == Shard(0, [range(2, 4)]) and inside("w" + SCALE_SUFFIX) == Shard(0, [range(0, 1)])
    assert inside.widened == {} and Fp8Shards(lambda name: Shard(0, [range(2, 4)]), (16, 8), {})("b") == \
        Shard(0, [range(2, 4)])                                           # no scale: a plain slice


def test_two_ranks_on_an_fp8_checkpoint_compute_the_logits_of_one(fp8_dir):
    """fp32: within 2e-5 of the logits' scale (the partial sums add in another order; the 128 x 128 checkpoint's
    logits differed by 1.02e-5 of it). A slice with wrong rows or scales is off by the weights' own size."""
    one = Executor(ModelRunner(load_model(fp8_dir), **SIZES))
    two = Executor.build_parallel(RankSpec(str(fp8_dir), 2, runner=SIZES))
    try:
        for (h1, l1), (h2, l2) in zip(_steps(one), _steps(two)):
            assert (l2 - l1).abs().max().item() <= 2e-5 * l1.abs().max().item()
            assert (h2 - h1).abs().max().item() <= 2e-5 * h1.abs().max().item()
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


def test_dummy_weights_of_an_fp8_config_keep_their_linears_in_fp8(fp8_dir, tmp_path):
    """--load-format dummy over an FP8 checkpoint's config.json (the 80B shape's benchmarks): the linears the format
    converts are FP8 as a checkpoint's would be, on one rank and on each of two (they stayed in bf16)."""
    (tmp_path / "config.json").write_text((fp8_dir / "config.json").read_text())
    for tp in (TensorParallel(), TensorParallel(1, 2)):
        model = load_model(tmp_path, load_format="dummy", fp8_weights=True, tp=tp).model
        assert sum(isinstance(m, Fp8Linear) for m in model.modules()) >= 8
