"""MoE routed experts kept in FP8 (issue 37): where FP8 weights stay FP8 (a GPU; here `fp8_weights=True` on the
CPU, through the dequantizing reference), each MoE layer holds its experts as float8_e4m3fn with block scales. From
an FP8 checkpoint they are its own bytes; from a bf16 one (`--quantization fp8`) the bytes an FP8 checkpoint of the
same weights stores. Logits equal the dequantized model's and speculation stays lossless."""
import pytest
import torch
from safetensors import safe_open
from test_fp8 import PROMPTS, speculation_matches_plain

from specdec.models.checkpoint_keys import strip_prefix
from specdec.models.loader import load_model
from specdec.models.mlp import SparseMoE
from specdec_tools.tiny import make_tiny


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """qwen3_5_moe tiny with experts 128 wide (gate and up each a whole 128-row block): FP8 and bf16 of the same
    weights."""
    root = tmp_path_factory.mktemp("fp8-experts")
    kwargs = dict(family="qwen3_5_moe", preset="tiny", seed=5, progress=False,
                  overrides={"vocab_size": 300, "moe_intermediate_size": 128})
    return make_tiny(root / "fp8", quantization="fp8", **kwargs), make_tiny(root / "bf16", **kwargs)


def moe_layers(loaded) -> dict[str, SparseMoE]:
    return {name: m for name, m in loaded.model.named_modules() if isinstance(m, SparseMoE)}


def logits(loaded, prompt: list[int]) -> torch.Tensor:
    from verifier_service.executor import Executor
    from verifier_service.model_runner import ModelRunner
    from verifier_service.sequence import Sequence
    executor = Executor(ModelRunner(loaded, num_blocks=16, block_size=16, max_seqs=2, max_drafts=3))
    return executor.forward([Sequence(0, list(prompt), len(prompt))], [prompt], logits="all")[1].clone()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_fp8_checkpoints_experts_stay_its_bytes(checkpoints, dtype):
    """Its bytes and its scales, whatever --dtype (quantizing the dequantized bf16 weights again would move the
    scales: max |w| rounds to bf16)."""
    fp8_dir, _ = checkpoints
    kept, dequantized = load_model(fp8_dir, dtype, fp8_weights=True), load_model(fp8_dir, dtype)
    layers = moe_layers(kept)
    assert layers and all(m.experts_gate_up.dtype == torch.float8_e4m3fn and m.fp8_block == (128, 128)
                          for m in layers.values())
    assert all(m.fp8_block is None and m.experts_gate_up.dtype == getattr(torch, dtype)
               for m in moe_layers(dequantized).values())
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as reader:
        names = {strip_prefix(k): k for k in reader.keys()}
        for name, m in layers.items():
            for e in range(m.num_experts):
                for part, rows in (("gate_proj", slice(0, 128)), ("up_proj", slice(128, 256))):
                    key = names[f"{name}.experts.{e}.{part}.weight"]
                    assert torch.equal(m.experts_gate_up[e, rows].view(torch.uint8),
                                       reader.get_tensor(key).view(torch.uint8)), (name, e, part)
                    assert torch.equal(m.experts_gate_up_scale_inv[e, rows.start // 128],
                                       reader.get_tensor(key + "_scale_inv")[0])
                key = names[f"{name}.experts.{e}.down_proj.weight"]
                assert torch.equal(m.experts_down[e].view(torch.uint8), reader.get_tensor(key).view(torch.uint8))
                assert torch.equal(m.experts_down_scale_inv[e], reader.get_tensor(key + "_scale_inv"))
    if dtype == "float32":
        prompt = PROMPTS[1] + PROMPTS[0]
        assert torch.allclose(logits(kept, prompt), logits(dequantized, prompt), atol=1e-5, rtol=1e-5)


def test_load_time_quantization_gives_the_fp8_checkpoints_experts(checkpoints):
    fp8_dir, bf16_dir = checkpoints
    stored, quantized = moe_layers(load_model(fp8_dir, fp8_weights=True)), \
        moe_layers(load_model(bf16_dir, quantization="fp8", fp8_weights=True))
    for name, m in stored.items():
        q = quantized[name]
        assert torch.equal(q.experts_gate_up.view(torch.uint8), m.experts_gate_up.view(torch.uint8))
        assert torch.equal(q.experts_down_scale_inv, m.experts_down_scale_inv)


def copied_with_config(source, folder, edit):
    """`source`'s files in `folder`, its config.json changed by edit(config)."""
    import json
    config = json.loads((source / "config.json").read_text())
    edit(config)
    for f in source.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_experts_not_converted_or_not_block_aligned_stay_dequantized(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints
    folder = copied_with_config(fp8_dir, tmp_path, lambda c: c["quantization_config"].update(
        modules_to_not_convert=["layers.0.mlp.experts"]))
    layers = moe_layers(load_model(folder, fp8_weights=True))
    assert layers["layers.0.mlp"].fp8_block is None and layers["layers.1.mlp"].fp8_block == (128, 128)
    narrow = make_tiny(tmp_path / "narrow", family="qwen3_5_moe", preset="tiny", seed=5, progress=False,
                       quantization="fp8", overrides={"vocab_size": 300})   # experts 32 wide: gate, up share a block
    assert all(m.fp8_block is None for m in moe_layers(load_model(narrow, fp8_weights=True)).values())


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_speculation_with_fp8_experts_is_lossless(checkpoints, kind):
    spec = speculation_matches_plain(checkpoints[0], kind)
    assert all(m.fp8_block for m in spec.executor.runner.model.modules() if isinstance(m, SparseMoE))


def test_bench_traffic_counts_fp8_experts_at_a_byte_a_weight(checkpoints):
    """The roofline's routed-expert bytes: what the loaded FP8 experts hold (a byte a weight, float32 scales)."""
    from specdec_tools.bench.traffic import ModelTraffic
    fp8_dir, bf16_dir = checkpoints
    plain = ModelTraffic.from_checkpoint(bf16_dir, "bfloat16")
    quantized = ModelTraffic.from_checkpoint(bf16_dir, "bfloat16", "fp8")
    layers = moe_layers(load_model(bf16_dir, quantization="fp8", fp8_weights=True)).values()
    held = sum(m.experts_gate_up.numel() + m.experts_down.numel()
               + 4 * (m.experts_gate_up_scale_inv.numel() + m.experts_down_scale_inv.numel()) for m in layers)
    assert quantized.expert_bytes == held and plain.expert_bytes == 2 * sum(
        m.experts_gate_up.numel() + m.experts_down.numel() for m in layers)
    assert ModelTraffic.from_checkpoint(fp8_dir, "bfloat16").expert_bytes == held
    assert plain.active_params == quantized.active_params


def test_experts_kept_in_fp8_are_never_dequantized(checkpoints, monkeypatch):
    """Loading does not make a --dtype copy of the experts it keeps in FP8 (the peak stays near the FP8 size): they
    are read as e4m3 and go to the layers as they are; the MTP head's experts and every other FP8 tensor are
    dequantized as before."""
    import specdec.models.loader as loader
    fp8_dir, _ = checkpoints
    seen = []
    dequantize = loader.dequantize_checkpoint

    def spy(tensors, fmt, dtype):
        seen.append(set(tensors))
        return dequantize(tensors, fmt, dtype)
    monkeypatch.setattr(loader, "dequantize_checkpoint", spy)
    load_model(fp8_dir, "bfloat16", fp8_weights=True)
    kept, = seen
    assert not [k for k in kept if ".experts." in k and not k.startswith("mtp.")]
    assert [k for k in kept if k.startswith("mtp.") and ".experts." in k]
    assert [k for k in kept if k.endswith("in_proj_qkv.weight")]
    load_model(fp8_dir, "bfloat16")
    assert [k for k in seen[1] if ".experts." in k and not k.startswith("mtp.")]


def test_fp8_tensors_without_a_quantization_config_are_refused(checkpoints, tmp_path):
    """e4m3 weights under a config.json without quantization_config: their scales cannot be read, so loading stops
    and names a tensor (it used to cast the raw e4m3 values into --dtype)."""
    from specdec.models.model_config import CheckpointError
    folder = copied_with_config(checkpoints[0], tmp_path, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="float8_e4m3fn but config.json has no FP8 quantization_config"):
        load_model(folder)
