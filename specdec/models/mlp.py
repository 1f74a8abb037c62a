"""Feed-forward blocks: dense SwiGLU (Qwen3.5) and sparse MoE with a sigmoid-gated shared expert
(Qwen3.5-MoE, Qwen3-Next)."""
import torch
from torch import nn

from kernels.activation import silu_mul
from kernels.moe import ExpertScales, SharedExpert, moe_experts
from kernels.moe_route import moe_route

from .fp8 import quantize_blocks
from .fused_linear import FusedLinear
from .model_config import ModelConfig


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H]
        return self.down_proj(silu_mul(self.gate_up.joined(x)))  # gate_up [T, 2I]: one GEMM


class SparseMoE(nn.Module):
    """Softmax router → top-k experts (weights renormalised when norm_topk_prob) + shared expert × sigmoid gate.

    Experts are stored fused: gate_up [E, 2I, H] (gate rows first), down [E, H, I], in the model's dtype or, after
    `keep_experts_fp8`, as FP8 with block scales (the kernels scale them as they read). The router and the shared
    expert's gate run as one GEMM ([T, E + 1]). On a GPU, without a host sync: `kernels.moe_route` picks each
    token's experts in one launch, `kernels.moe.moe_experts` runs them with the shared expert and its gate
    (per-pair GEMVs or per-expert scan kernels, the shared expert fused in, for decode and verify steps; grouped
    GEMMs for prompt chunks).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inter, experts = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.top_k, self.renormalise, self.num_experts = config.num_experts_per_tok, config.norm_topk_prob, experts
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.zeros(experts, 2 * inter, hidden))
        self.experts_down = nn.Parameter(torch.zeros(experts, hidden, inter))
        self.shared_expert = SwiGLU(hidden, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.router = FusedLinear(self.gate, self.shared_expert_gate)
        self.fp8_block: tuple[int, int] | None = None       # set by keep_experts_fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H]
        logits = self.router.joined(x)                                                   # [T, E + 1]
        weights, chosen = moe_route(logits[:, :self.num_experts], self.top_k, self.renormalise)  # [T, top_k]
        scales = None if self.fp8_block is None else ExpertScales(
            self.experts_gate_up_scale_inv, self.experts_down_scale_inv, self.fp8_block)
        return moe_experts(x, self.experts_gate_up, self.experts_down, weights, chosen,  # [T, H]
                           self._shared(x, logits[:, self.num_experts:]), scales)

    def keep_experts_fp8(self, block: tuple[int, int],
                         stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                         num_experts_per_call: int = 16) -> None:
        """Hold the routed experts as FP8 (float8_e4m3fn, one float32 scale per `block`): `stored` = an FP8
        checkpoint's {"experts_gate_up": (e4m3, scales), "experts_down": ...} as they are, else quantized from the
        loaded weights a few experts at a time (scale = max |w| of the block / 448, as Qwen's checkpoints store
        them)."""
        if self.fp8_block is not None:
            raise RuntimeError("SparseMoE: the experts are FP8 already")
        parts = dict(stored or {})
        for name in ("experts_gate_up", "experts_down"):
            if name not in parts:
                w = getattr(self, name).detach()
                q, s = zip(*(quantize_blocks(w[e:e + num_experts_per_call], block)
                             for e in range(0, w.shape[0], num_experts_per_call)))
                parts[name] = (torch.cat(q), torch.cat(s))
        for name, (q, s) in parts.items():
            if q.shape != getattr(self, name).shape:
                raise ValueError(f"SparseMoE: FP8 {name} of shape {tuple(q.shape)}, the layer's is "
                                 f"{tuple(getattr(self, name).shape)}")
            setattr(self, name, nn.Parameter(q, requires_grad=False))              # [E, out, in] e4m3
            self.register_buffer(f"{name}_scale_inv", s)                # [E, ceil(out/b0), ceil(in/b1)] float32
        self.fp8_block = block

    def _shared(self, x: torch.Tensor, gate: torch.Tensor) -> SharedExpert:  # gate [T, 1]
        """The shared expert as its weights when they are plain tensors (the kernels may fuse it), else (FP8) its
        output."""
        gate_up, down = self.shared_expert.gate_up.plain_weight(), self.shared_expert.down_proj
        if gate_up is not None and isinstance(down, nn.Linear):
            return SharedExpert(gate, gate_up=gate_up, down=down.weight)
        return SharedExpert(gate, output=self.shared_expert(x))
