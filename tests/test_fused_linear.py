"""FusedLinear: linears that share an input run as one GEMM with the same outputs, keep their names and memory,
and are fused again when a weight is replaced."""
import torch
from torch import nn

from specdec.models.fused_linear import FusedLinear


def linears(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(12, 5, bias=False), nn.Linear(12, 7, bias=False), nn.Linear(12, 1, bias=False)


def test_outputs_equal_the_separate_linears_and_weights_become_views():
    parts = linears()
    x = torch.randn(3, 12)
    want = [p(x) for p in parts]
    fused = FusedLinear(*parts)
    got = fused(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert fused.weight.shape == (13, 12)
    assert [p.weight.data_ptr() for p in parts] == [fused.weight[i].data_ptr() for i in (0, 5, 12)]
    assert torch.equal(fused.joined(x), torch.cat(got, dim=-1))


def test_a_replaced_weight_is_fused_again():
    parts = linears()
    fused = FusedLinear(*parts)
    x = torch.randn(2, 12)
    fused(x)
    parts[1].weight = nn.Parameter(torch.full((7, 12), 0.5))     # as load_state_dict(assign=True) would
    torch.testing.assert_close(fused(x)[1], x @ torch.full((12, 7), 0.5))
    parts[2].weight.data.mul_(0)                                 # in place: the view is the fused row
    assert torch.equal(fused(x)[2], torch.zeros(2, 1))


def test_a_dtype_change_is_fused_again():
    parts = linears()
    fused = FusedLinear(*parts)
    fused(torch.randn(2, 12))
    for p in parts:
        p.to(torch.float64)
    assert fused(torch.randn(2, 12, dtype=torch.float64))[0].dtype == torch.float64


def test_bias_is_refused():
    import pytest
    with pytest.raises(ValueError, match="no bias"):
        FusedLinear(nn.Linear(4, 4), nn.Linear(4, 2, bias=False))


def test_state_dict_keeps_the_names_under_inference_mode():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, _ = linears()
            self.ab = FusedLinear(self.a, self.b)

    block = Block()
    before = {k: v.clone() for k, v in block.state_dict().items()}
    with torch.inference_mode():
        block.ab(torch.randn(1, 12))
    after = block.state_dict()
    assert set(after) == {"a.weight", "b.weight"}
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_fuse_projections_fuses_every_layer_of_a_loaded_model(tiny_dir):
    """load_model fuses the GDN, attention and MLP projections: each layer's weights are views of one tensor."""
    from specdec.models.fused_linear import fuse_projections
    from specdec.models.loader import load_model
    model = load_model(tiny_dir).model
    for layer in model.layers:
        mixer = layer.self_attn.qkv_proj if layer.is_attention else layer.linear_attn.in_proj
        for fused in (mixer, layer.mlp.gate_up):
            assert fused.is_current()
            assert fused.linears[0].weight.data_ptr() == fused.weight.data_ptr()
    assert fuse_projections(model) == 2 * len(model.layers)


def test_fusing_again_leaves_fused_weights_where_graphs_read_them(tiny_dir):
    """A second ModelRunner over the same model fuses again: rows already fused keep their addresses (a first
    runner's CUDA graphs read them there; re-fusing freed them and its replays read reused memory on the GPU)."""
    from specdec.models.fused_linear import fuse_projections
    from specdec.models.loader import load_model
    from verifier_service.model_runner import ModelRunner
    loaded = load_model(tiny_dir)
    model = loaded.model
    addresses = [p.data_ptr() for p in model.parameters()]
    for _ in range(2):
        ModelRunner(loaded, num_blocks=8, block_size=4, max_seqs=1)
    assert [p.data_ptr() for p in model.parameters()] == addresses
    layer = model.layers[0]
    mixer = layer.self_attn.qkv_proj if layer.is_attention else layer.linear_attn.in_proj
    mixer.linears[0].weight = nn.Parameter(mixer.linears[0].weight.detach().clone(), requires_grad=False)
    fuse_projections(model)                       # a replaced weight is still fused again
    assert mixer.is_current() and mixer.linears[0].weight.data_ptr() == mixer.weight.data_ptr()
