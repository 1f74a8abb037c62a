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


def test_fp8_under_tensor_parallelism_is_refused(checkpoints):
    with pytest.raises(ValueError, match="not supported yet"):
        build_engine(VerifierConfig(str(checkpoints[0]), tensor_parallel_size=2, num_drafts=0, warm_up=False))
    with pytest.raises(ValueError, match="not supported yet"):
        build_engine(VerifierConfig(str(checkpoints[1]), tensor_parallel_size=2, num_drafts=0, warm_up=False,
                                    quantization="fp8"))


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
