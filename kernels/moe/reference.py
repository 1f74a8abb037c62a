"""Pure-torch routed experts of a sparse MoE block (the CPU path and the reference of the Triton kernels).

For token t with chosen experts e_1..e_K and routing weights w_1..w_K (softmax top-k, renormalised by the caller):
    out_t = Σ_j w_j · down_e_j( silu(gate_e_j(x_t)) · up_e_j(x_t) )  [ + sigmoid(g_t) · s_t ]
where s_t is the shared expert's output and g_t its gate's logit, when the block has one (`SharedExpert`: added
here so that the decode and scan kernels can run the shared expert as one more row per token and fuse the combine).
Experts are stored fused: gate_up [E, 2I, H] (gate rows first), down [E, H, I], in the model's dtype or as FP8
(float8_e4m3fn with `ExpertScales`: the real weight is w[e, i, j] · scale[e, i // b0, j // b1], the fused matrix
blocked as one, partial edge blocks included; the reference dequantizes a reached expert into x's dtype, as the
kernels do tile by tile). The loop over the experts that were chosen reads their ids on the host
(`.unique().tolist()`): fine on a CPU, a host sync on a GPU — which is why CUDA tensors take the Triton path.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.activation import silu_mul


@dataclass(frozen=True)
class SharedExpert:
    """A MoE block's shared expert, added as sigmoid(gate) · its output: given as its weights (the decode and scan
    kernels fuse it when its width equals the experts') or, when they are not plain tensors (FP8), as its output."""
    gate: torch.Tensor                      # [T, 1] the shared expert gate's logit (may be a column view)
    gate_up: torch.Tensor | None = None     # [2S, H] gate rows first
    down: torch.Tensor | None = None        # [H, S]
    output: torch.Tensor | None = None      # [T, H] instead of the weights

    def __post_init__(self):
        if (self.output is None) == (self.gate_up is None or self.down is None):
            raise ValueError("SharedExpert: give either its output or both its weights")

    def computed(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] → [T, H]
        """The output: given, or down(silu(gate(x)) · up(x)) as SwiGLU computes it."""
        return self.output if self.output is not None else F.linear(silu_mul(F.linear(x, self.gate_up)), self.down)

    def added(self, routed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [T, H] → [T, H]
        return routed + self.computed(x) * torch.sigmoid(self.gate)


@dataclass(frozen=True)
class ExpertScales:
    """Block scales of FP8 routed experts (gate_up and down float8_e4m3fn)."""
    gate_up: torch.Tensor                   # [E, ceil(2I / b0), ceil(H / b1)] float32
    down: torch.Tensor                      # [E, ceil(H / b0), ceil(I / b1)] float32
    block: tuple[int, int]                  # (b0, b1): rows, columns of a block

    def weight(self, w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One expert's real weight w [out, in] (e4m3) · scale [ceil(out/b0), ceil(in/b1)] in `dtype`."""
        b0, b1 = self.block
        full = scale.repeat_interleave(b0, 0)[:w.shape[0]].repeat_interleave(b1, 1)[:, :w.shape[1]]
        return (w.float() * full).to(dtype)


def moe_experts_ref(
    x: torch.Tensor,             # [T, H]
    gate_up: torch.Tensor,       # [E, 2I, H]
    down: torch.Tensor,          # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,      # [T, K] int64
    shared: SharedExpert | None = None,
    scales: ExpertScales | None = None,   # FP8 experts' block scales (None: gate_up / down in x's dtype)
) -> torch.Tensor:               # [T, H]
    weights = topk_weights.to(x.dtype)
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        token_idx, k_idx = (topk_ids == expert).nonzero(as_tuple=True)
        w_gate_up, w_down = gate_up[expert], down[expert]
        if scales is not None:
            w_gate_up = scales.weight(w_gate_up, scales.gate_up[expert], x.dtype)
            w_down = scales.weight(w_down, scales.down[expert], x.dtype)
        gate, up = F.linear(x[token_idx], w_gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down)                            # [n, H]
        out.index_add_(0, token_idx, y * weights[token_idx, k_idx, None])
    return out if shared is None else shared.added(out, x)
