"""FP8 checkpoints as Qwen ships them (issue 37, the CPU part): the block-scale math with partial edge blocks, the
rounding error of e4m3, `make-tiny --quantization fp8` read back exactly as `--quantization fp8` rounds the same
bf16 weights, what stays unconverted, clear refusals, and lossless speculation on an FP8 checkpoint."""
import json
import math

import pytest
import torch
from safetensors import safe_open

from specdec.models.fp8 import (E4M3_MAX, Fp8Format, dequantize_blocks, dequantize_checkpoint, quantize_blocks,
                                round_through_fp8)
from specdec.models.loader import load_model
from specdec.models.model_config import CheckpointError
from specdec.sampling_params import SamplingParams
from specdec_tools.commands.in_process_drafter import in_process_drafter
from specdec_tools.tiny import make_tiny
from verifier_service.builder import VerifierConfig, build_engine

PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 7, 7, 7, 7, 7, 7], [200, 1, 30], [11, 12, 13, 14]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    kwargs = dict(family="qwen3_5_moe", preset="tiny", seed=3, overrides={"vocab_size": 300})
    return make_tiny(root / "fp8", quantization="fp8", **kwargs), make_tiny(root / "bf16", **kwargs)


def test_dequantize_scales_each_block_partial_edges_included():
    weight = torch.randn(5, 7)
    scale_inv = torch.tensor([[2.0, 3.0, 5.0], [7.0, 11.0, 13.0]])          # blocks of 4 x 3: 2 x 3 of them
    got = dequantize_blocks(weight, scale_inv, (4, 3), torch.float32)
    want = torch.stack([torch.stack([weight[i, j] * scale_inv[i // 4, j // 3] for j in range(7)]) for i in range(5)])
    assert torch.equal(got, want)
    with pytest.raises(CheckpointError, match="do not fit"):
        dequantize_blocks(weight, scale_inv[:, :2], (4, 3), torch.float32)


def test_quantized_blocks_round_within_e4m3s_precision():
    weight = torch.randn(3, 200, 130) * torch.logspace(-3, 1, 200)[None, :, None]   # blocks of very unlike size
    q, scale_inv = quantize_blocks(weight, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2, 2) and scale_inv.dtype == torch.float32
    assert q.float().abs().max() <= E4M3_MAX
    back = dequantize_blocks(q, scale_inv, (128, 128), torch.float32)
    scales = scale_inv.repeat_interleave(128, -2)[..., :200, :].repeat_interleave(128, -1)[..., :130]
    # e4m3: 3 mantissa bits (half a step: 2^-4 relative), subnormal steps of 2^-9 (half: 2^-10) times the scale
    bound = torch.maximum(weight.abs() * 2 ** -4, scales * 2 ** -10)
    assert ((back - weight).abs() <= bound * (1 + 1e-6)).all()
    assert (back - weight).abs().max() > 0                                   # it did round


def test_an_fp8_tiny_checkpoint_reads_back_as_load_time_fp8_rounding(checkpoints):
    fp8_dir, bf16_dir = checkpoints
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                             "activation_scheme": "dynamic", "modules_to_not_convert": []}
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as reader:
        dtypes = {k: reader.get_tensor(k).dtype for k in reader.keys()}
    assert dtypes["model.layers.0.linear_attn.in_proj_qkv.weight"] == torch.float8_e4m3fn
    assert dtypes["model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"] == torch.float32
    for kept in ("model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.linear_attn.conv1d.weight", "model.layers.0.linear_attn.A_log"):
        assert dtypes[kept] == torch.float32, kept
    stored = load_model(fp8_dir).model.state_dict()
    rounded = load_model(bf16_dir, quantization="fp8").model.state_dict()
    plain = load_model(bf16_dir).model.state_dict()
    assert all(torch.equal(stored[k], rounded[k]) for k in stored)
    changed = [k for k in stored if not torch.equal(stored[k], plain[k])]
    assert "layers.0.mlp.experts_gate_up" in changed and "embed_tokens.weight" not in changed


def test_what_is_not_converted():
    fmt = Fp8Format(not_converted=("mtp", "model.layers.3.self_attn"))
    assert fmt.converts("layers.0.self_attn.q_proj.weight", (64, 64))
    assert fmt.converts("layers.0.mlp.experts.gate_up_proj", (4, 64, 64))
    for name, shape in [("mtp.layers.0.self_attn.q_proj.weight", (64, 64)), ("layers.3.self_attn.o_proj.weight",
                        (64, 64)), ("lm_head.weight", (300, 64)), ("embed_tokens.weight", (300, 64)),
                        ("layers.0.mlp.gate.weight", (4, 64)), ("layers.0.mlp.shared_expert_gate.weight", (1, 64)),
                        ("layers.0.linear_attn.conv1d.weight", (96, 1, 4)), ("layers.0.input_layernorm.weight", (64,))]:
        assert not fmt.converts(name, shape), name
    given = {"embed_tokens.weight": torch.randn(300, 64), "mtp.fc.weight": torch.randn(64, 128),
             "layers.0.mlp.down_proj.weight": torch.randn(64, 96)}
    rounded = round_through_fp8(given, fmt)
    assert torch.equal(rounded["embed_tokens.weight"], given["embed_tokens.weight"])
    assert torch.equal(rounded["mtp.fc.weight"], given["mtp.fc.weight"])
    assert not torch.equal(rounded["layers.0.mlp.down_proj.weight"], given["layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize("quant, words", [({"quant_method": "awq"}, "not supported"),
                                          ({"quant_method": "fp8", "activation_scheme": "static"}, "dynamic"),
                                          ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive")])
def test_unreadable_quantizations_are_refused(quant, words):
    with pytest.raises(CheckpointError, match=words):
        Fp8Format.from_config({"quantization_config": quant})


def test_missing_scales_and_orphan_scales_are_named():
    weight = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match="has no x.weight_scale_inv"):
        dequantize_checkpoint({"x.weight": weight}, Fp8Format(), torch.float32)
    with pytest.raises(CheckpointError, match="has no weight"):
        dequantize_checkpoint({"y.weight_scale_inv": torch.ones(1, 1)}, Fp8Format(), torch.float32)
    assert Fp8Format.from_config({"model_type": "qwen3_5_text"}) is None


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_speculation_on_an_fp8_checkpoint_is_lossless(checkpoints, kind):
    def engine(drafter):
        config = VerifierConfig(model_dir=str(checkpoints[0]), num_drafts=3 if drafter else 0,
                                in_process_drafter=drafter, max_context=128, max_running=4, max_batched_tokens=64,
                                prefill_chunk=16, warm_up=False)
        return build_engine(config, in_process_drafter(drafter) if drafter else None)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    spec = engine(kind)
    assert spec.generate(PROMPTS, params) == engine(None).generate(PROMPTS, params)
    assert spec.stats.drafted > 0 and math.isfinite(spec.stats.mean_acceptance_length)


def test_a_drafter_service_reads_the_fp8_mtp_head_dequantized(checkpoints):
    from specdec.models.loader import load_drafter_weights
    fp8_dir, bf16_dir = checkpoints
    _, mtp, shared = load_drafter_weights(fp8_dir)
    verifier_side = load_model(fp8_dir).mtp_weights
    assert mtp.keys() == verifier_side.keys() and all(torch.equal(mtp[k], verifier_side[k]) for k in mtp)
    plain = load_drafter_weights(bf16_dir)[1]
    assert any(not torch.equal(mtp[k], plain[k]) for k in mtp)                 # its linears were FP8
    assert all(t.dtype == torch.float32 for t in [*mtp.values(), *shared.values()])


# FP8 weights kept in FP8 (what a GPU loads; here through the kernels' torch reference)

def test_fp8_linears_keep_the_checkpoints_bytes_and_give_the_dequantized_logits(checkpoints, monkeypatch):
    import specdec.models.fp8_linear as fp8_linear
    from specdec.models.fp8_linear import Fp8Linear
    fp8_dir, _ = checkpoints
    dequantized = load_model(fp8_dir)
    with monkeypatch.context() as patch:      # an FP8 checkpoint's linears are its bytes, never quantized again
        patch.setattr(fp8_linear, "quantize_blocks", lambda *a: pytest.fail("an FP8 checkpoint's linear re-quantized"))
        kept = load_model(fp8_dir, fp8_weights=True)
    linears = {name: m for name, m in kept.model.named_modules() if isinstance(m, Fp8Linear)}
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears.values())
    assert not isinstance(kept.model.lm_head, Fp8Linear) and kept.model.lm_head.weight.dtype == torch.float32
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as reader:
        from specdec.models.checkpoint_keys import strip_prefix
        names = {strip_prefix(k): k for k in reader.keys()}
        for name, module in linears.items():
            key = names[name + ".weight"]
            assert torch.equal(module.weight.view(torch.uint8), reader.get_tensor(key).view(torch.uint8)), name
            assert torch.equal(module.weight_scale_inv, reader.get_tensor(key + "_scale_inv"))
    prompt = PROMPTS[1] + PROMPTS[0]                          # activations stay in their dtype: the same arithmetic
    assert torch.allclose(_logits(kept, prompt), _logits(dequantized, prompt), atol=1e-5, rtol=1e-5)


def test_load_time_fp8_linears_quantize_the_bf16_weights(checkpoints):
    """In bf16 (where rounding through FP8 first, then quantizing again, would move the scales) each linear is
    quantized once from its exact weight, as the FP8 checkpoint written from the same weights stores it."""
    from specdec.models.fp8_linear import Fp8Linear
    fp8_dir, bf16_dir = checkpoints
    kept = load_model(bf16_dir, "bfloat16", quantization="fp8", fp8_weights=True)
    plain = dict(load_model(bf16_dir, "bfloat16").model.named_modules())
    linears = [(name, m) for name, m in kept.model.named_modules() if isinstance(m, Fp8Linear)]
    assert linears
    for name, module in linears:
        q, s = quantize_blocks(plain[name].weight, (128, 128))
        assert torch.equal(module.weight.float(), q.float()) and torch.equal(module.weight_scale_inv, s), name
    prompt = PROMPTS[0] + PROMPTS[2]             # (the checkpoints hold fp32 weights, which the FP8 one quantized)
    assert torch.equal(_logits(load_model(bf16_dir, quantization="fp8", fp8_weights=True), prompt),
                       _logits(load_model(fp8_dir, fp8_weights=True), prompt))


def speculation_matches_plain(fp8_dir, kind: str):
    """Engines on `fp8_dir` with its FP8 weights kept, with the `kind` drafter and without: the same greedy tokens
    for PROMPTS, drafts verified. Returns the speculating engine."""
    def engine(drafter):
        config = VerifierConfig(model_dir=str(fp8_dir), num_drafts=3 if drafter else 0, in_process_drafter=drafter,
                                max_context=128, max_running=4, max_batched_tokens=64, prefill_chunk=16,
                                warm_up=False)
        return build_engine(config, in_process_drafter(drafter) if drafter else None,
                            load_model(fp8_dir, fp8_weights=True))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    spec = engine(kind)
    assert spec.generate(PROMPTS, params) == engine(None).generate(PROMPTS, params)
    assert spec.stats.drafted > 0
    return spec


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_speculation_with_fp8_linears_is_lossless(checkpoints, kind):
    speculation_matches_plain(checkpoints[0], kind)


def _logits(loaded, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt, prefilled in one step."""
    from verifier_service.executor import Executor
    from verifier_service.model_runner import ModelRunner
    from verifier_service.sequence import Sequence
    executor = Executor(ModelRunner(loaded, num_blocks=16, block_size=16, max_seqs=2, max_drafts=3))
    return executor.forward([Sequence(0, list(prompt), len(prompt))], [prompt], logits="all")[1].clone()


def test_fused_fp8_linears_start_each_part_on_a_scale_block():
    """Parts of 40, 200 and 8 rows in 32-row blocks: the 40 is followed by 24 zero rows and the 200 by 24, so each
    part's scales are its own; the outputs equal each linear alone. A group with an unconverted linear runs apart."""
    from torch import nn

    from specdec.models.fp8_linear import Fp8Linear
    from specdec.models.fused_linear import FusedLinear
    torch.manual_seed(0)
    dense = [nn.Linear(64, n, bias=False) for n in (40, 200, 8)]
    for linear, scale in zip(dense, (1.0, 30.0, 0.01)):
        linear.weight.data *= scale                                   # scale blocks that must not mix
    fp8 = [Fp8Linear(*quantize_blocks(linear.weight.detach(), (32, 32)), (32, 32)) for linear in dense]
    x = torch.randn(5, 64)
    alone = [linear(x) for linear in fp8]
    fused = FusedLinear(*dense)
    fused.replace_linears({id(d): f for d, f in zip(dense, fp8)})
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fused(x), alone))
    assert fused.offsets == [0, 64, 288] and fused.weight.shape == (296, 64) and fused.scale_inv.shape == (10, 2)
    assert torch.allclose(fused.joined(x), torch.cat(alone, dim=-1), atol=1e-5)
    assert fp8[1].weight.data_ptr() == fused.weight[64].data_ptr()   # the linears' rows are views of the fused rows
    weight = fused.weight
    fused(x)
    assert fused.is_current() and fused.weight is weight              # fused once, not at every call
    mixed = FusedLinear(fp8[0], dense[1])
    assert torch.allclose(mixed.joined(x), torch.cat([alone[0], dense[1](x)], dim=-1)) and mixed.weight is None
    again = FusedLinear(*dense[:2])                                   # fused as FP8, then one part unconverted
    again.replace_linears({id(dense[0]): fp8[0], id(dense[1]): fp8[1]})
    again(x)
    again.replace_linears({id(fp8[1]): dense[1]})
    assert [part.shape for part in again(x)] == [(5, 40), (5, 200)]


def test_bench_traffic_counts_fp8_linears_at_a_byte_a_weight(checkpoints):
    """The roofline's bytes a step reads: each FP8 linear one byte a weight plus its fp32 scales, the rest as before."""
    from specdec.models.fp8_linear import Fp8Linear
    from specdec_tools.bench.traffic import ModelTraffic
    fp8_dir, bf16_dir = checkpoints
    plain = ModelTraffic.from_checkpoint(bf16_dir, "bfloat16")
    quantized = ModelTraffic.from_checkpoint(bf16_dir, "bfloat16", "fp8")
    kept = load_model(bf16_dir, quantization="fp8", fp8_weights=True).model
    saved = sum(m.weight.numel() - m.weight_scale_inv.numel() * 4 for m in kept.modules() if isinstance(m, Fp8Linear))
    assert saved > 0 and plain.weight_bytes - quantized.weight_bytes == saved
    assert ModelTraffic.from_checkpoint(fp8_dir, "bfloat16").weight_bytes == quantized.weight_bytes
    assert quantized.linear_shapes == plain.linear_shapes


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_gpu_fp8_kernels_in_cuda_graphs_decode_as_plain(checkpoints, kind):
    """On CUDA an FP8 checkpoint keeps its linears in FP8 (Triton kernels, captured in the step graphs); bf16
    speculation gives plain decoding's greedy tokens."""
    from specdec.models.fp8_linear import Fp8Linear
    fp8_dir, _ = checkpoints
    assert any(isinstance(m, Fp8Linear) for m in load_model(fp8_dir, "bfloat16", "cuda").model.modules())

    def engine(drafter):
        config = VerifierConfig(model_dir=str(fp8_dir), device="cuda", dtype="bfloat16",
                                num_drafts=3 if drafter else 0, in_process_drafter=drafter, max_context=128,
                                max_running=4, max_batched_tokens=64, prefill_chunk=16, warm_up=False)
        return build_engine(config, in_process_drafter(drafter) if drafter else None)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    spec = engine(kind)
    assert spec.generate(PROMPTS, params) == engine(None).generate(PROMPTS, params)
    assert spec.stats.drafted > 0


def test_a_moe_block_hands_the_kernels_a_plain_shared_expert_and_an_fp8_one_as_its_output(checkpoints):
    """FusedLinear.plain_weight is the fused weight of plain linears and None once they are FP8 (or run apart): so
    SparseMoE gives the expert kernels its shared expert's weights, or, FP8, its output; both forwards equal the
    block computed by hand."""
    import torch.nn.functional as F
    from torch import nn

    from specdec.models.fp8_linear import Fp8Linear
    from specdec.models.fused_linear import FusedLinear
    from specdec.models.mlp import SparseMoE
    from specdec.models.model_config import ModelConfig
    torch.manual_seed(0)
    block = SparseMoE(ModelConfig.from_folder(checkpoints[1]))
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(3, block.gate.in_features)
    s = block.shared_expert

    def by_hand():
        logits = block.gate(x)
        weights, ids = torch.softmax(logits.float(), -1).topk(block.top_k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = sum(weights[:, j, None] * torch.stack([
            F.linear(F.silu(F.linear(x[t], block.experts_gate_up[e][:block.experts_down.shape[2]]))
                     * F.linear(x[t], block.experts_gate_up[e][block.experts_down.shape[2]:]), block.experts_down[e])
            for t, e in enumerate(ids[:, j].tolist())]) for j in range(block.top_k))
        shared = s.down_proj(F.silu(s.gate_proj(x)) * s.up_proj(x))
        return routed + shared * torch.sigmoid(block.shared_expert_gate(x))

    plain = block._shared(x, block.shared_expert_gate(x))
    assert plain.output is None and plain.gate_up.data_ptr() == s.gate_proj.weight.data_ptr()
    assert torch.allclose(block(x), by_hand(), atol=1e-5)
    fp8 = {id(m): Fp8Linear(*quantize_blocks(m.weight.detach(), (32, 32)), (32, 32))
           for m in (s.gate_proj, s.up_proj, s.down_proj)}
    s.gate_proj, s.up_proj, s.down_proj = fp8[id(s.gate_proj)], fp8[id(s.up_proj)], fp8[id(s.down_proj)]
    s.gate_up.replace_linears(fp8)
    assert s.gate_up.plain_weight() is None
    as_output = block._shared(x, block.shared_expert_gate(x))
    assert as_output.gate_up is None and as_output.output is not None
    assert torch.allclose(block(x), by_hand(), atol=1e-5)
    apart = FusedLinear(s.gate_proj, nn.Linear(x.shape[1], 4, bias=False))
    assert apart.plain_weight() is None and apart.apart
