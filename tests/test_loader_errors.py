"""Bad checkpoints fail with one error that names the problem."""
import json

import pytest
import torch
from hf_reference import make_hf_model
from safetensors.torch import load_file, save_file

from specdec.models.loader import load_model
from specdec.models.model_config import CheckpointError


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    make_hf_model("qwen3_5", path, seed=1)
    return path


def copy_with(good, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    tensors = load_file(good / "model.safetensors")
    config = json.loads((good / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_tensor_is_named(good, tmp_path):
    bad = copy_with(good, tmp_path / "bad", lambda t: t.pop("model.layers.3.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor layers\.3\.self_attn\.k_proj\.weight"):
        load_model(bad)


def test_wrong_shape_is_named(good, tmp_path):
    def shrink(t):
        t["model.layers.0.linear_attn.in_proj_z.weight"] = torch.zeros(8, 48)
    bad = copy_with(good, tmp_path / "bad", shrink)
    with pytest.raises(CheckpointError, match=r"tensor layers\.0\.linear_attn\.in_proj_z\.weight has shape "
                                              r"\(8, 48\), expected \(64, 48\)"):
        load_model(bad)


def test_unexpected_tensor_is_named(good, tmp_path):
    def add(t):
        t["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(CheckpointError, match=r"unexpected tensor layers\.1\.self_attn\.q_proj\.weight"):
        load_model(copy_with(good, tmp_path / "bad", add))


def test_unknown_model_type(good, tmp_path):
    bad = copy_with(good, tmp_path / "bad", edit_config=lambda c: c.update(model_type="llama"))
    with pytest.raises(CheckpointError, match=r"unsupported model_type 'llama'"):
        load_model(bad)


def test_missing_config_field(good, tmp_path):
    bad = copy_with(good, tmp_path / "bad", edit_config=lambda c: c.pop("linear_num_value_heads"))
    with pytest.raises(CheckpointError, match=r"missing required field 'linear_num_value_heads'"):
        load_model(bad)


def test_corrupt_safetensors(good, tmp_path):
    bad = copy_with(good, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:8] + b"{garbage" + data[16:200])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(bad)


def test_missing_weights_and_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"not valid JSON"):
        load_model(tmp_path)


def test_missing_shard(good, tmp_path):
    bad = copy_with(good, tmp_path / "bad")
    (bad / "model.safetensors").rename(bad / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"names shard model-00002-of-00002\.safetensors, which is missing"):
        load_model(bad)


def test_our_kernels_package_is_not_mistaken_for_hf_kernels():
    import transformers.utils.import_utils as iu
    import kernels  # ours
    assert "specdec" in kernels.__doc__ or "pure-torch" in kernels.__doc__
    assert iu.is_kernels_available() is False
