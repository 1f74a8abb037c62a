"""Linear over a block-scaled FP8 weight (Qwen's float8_e4m3fn with 128 x 128 float32 scales; activations in their
dtype), dispatched by device: CUDA tensors run the Triton kernels (imported on first use), everything else the
torch reference."""
import torch

from .reference import dequantize_weight, fp8_linear_ref


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] · (weight [N, K] e4m3 × scale_inv [ceil(N/B0), ceil(K/B1)] per block)ᵀ → [M, N] in x's dtype."""
    if x.is_cuda:
        from .triton_fp8_linear import fp8_linear_triton
        return fp8_linear_triton(x, weight, scale_inv, block)
    return fp8_linear_ref(x, weight, scale_inv, block)


__all__ = ["dequantize_weight", "fp8_linear", "fp8_linear_ref"]
