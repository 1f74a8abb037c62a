"""Helpers for the GDN / conv kernel tests: ragged batches with padding, and Triton modules in interpreter mode."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


def load_interpreted(module_name: str):
    """The Triton kernel module, for tests that run it on CPU tensors in the interpreter: conftest sets
    TRITON_INTERPRET=1 on machines without CUDA before triton is imported; elsewhere these tests skip."""
    import pytest
    pytest.importorskip("triton")
    from triton import knobs
    if not knobs.runtime.interpret:
        pytest.skip("TRITON_INTERPRET is not set: this machine runs the compiled kernels (gpu tests)")
    return importlib.import_module(module_name)


@dataclass
class RaggedCase:
    """A ragged step: real sequences (some with drafts) interleaved with 0-length padding sequences, which
    all use the scratch slot (the last one), plus `tail` padding tokens that belong to no sequence."""
    lens: list[int]
    drafts: list[int]
    max_drafts: int
    num_slots: int
    tail: int = 0
    seed: int = 0

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        real = [i for i, n in enumerate(self.lens) if n > 0]
        free = torch.randperm(self.num_slots - 1, generator=g).tolist()
        self.slot_list = [free.pop() if n > 0 else self.num_slots - 1 for n in self.lens]
        self.offset_list = [int(torch.randint(0, self.max_drafts + 1, (1,), generator=g)) if i in real else 0
                            for i in range(len(self.lens))]
        cu = [0]
        for n in self.lens:
            cu.append(cu[-1] + n)
        self.cu_list = cu
        # absolute positions: each real sequence starts past the drafts it replays (GDN), tail tokens at 0
        starts = [off + int(torch.randint(0, 13, (1,), generator=g)) for off in self.offset_list]
        self.start_list = starts
        self.position_list = [starts[b] + i for b, n in enumerate(self.lens) for i in range(n)] + [0] * self.tail

    @property
    def num_tokens(self) -> int:
        return self.cu_list[-1] + self.tail

    @property
    def max_seqlen(self) -> int:
        return max(self.lens)

    def tensors(self, device="cpu") -> tuple[torch.Tensor, ...]:
        """(cu_seqlens, slots, read_offsets, num_drafts) as int32 device tensors."""
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
        return as_i32(self.cu_list), as_i32(self.slot_list), as_i32(self.offset_list), as_i32(self.drafts)

    def positions(self, device="cpu") -> torch.Tensor:
        return torch.tensor(self.position_list, dtype=torch.int64, device=device)

    def token_ranges(self):
        """(sequence index, flat token range) of the real sequences."""
        return [(b, range(self.cu_list[b], self.cu_list[b + 1])) for b in range(len(self.lens)) if self.lens[b]]

    def real_token_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.num_tokens, dtype=torch.bool)
        mask[: self.cu_list[-1]] = True
        return mask


# Odd lengths, k = 0..4 drafts, 0-length padding sequences in the middle and at the end, tail tokens.
CASES = {
    "decode-b1": RaggedCase([1], [0], 0, 3),
    "verify-k0..4": RaggedCase([1, 2, 3, 4, 5], [0, 1, 2, 3, 4], 4, 7, seed=1),
    "verify-padded": RaggedCase([4, 0, 2, 4, 0, 0], [3, 0, 1, 3, 0, 0], 3, 6, tail=5, seed=2),
    "prefill-ragged": RaggedCase([7, 1, 13, 0], [0, 0, 0, 0], 2, 5, seed=3),
    "mixed-prefill-verify": RaggedCase([9, 3, 1], [0, 2, 0], 2, 5, tail=2, seed=4),
}

# The same at the sizes of the 4B model (GPU tests): batches 1 / 8 / 32 with k = 3, padding, a 300-token prefill.
GPU_CASES = {
    "b1-decode": RaggedCase([1], [0], 3, 2),
    "b8-verify-k3": RaggedCase([4] * 6 + [2, 1], [3] * 6 + [1, 0], 3, 10, seed=7),
    "b32-verify-padded": RaggedCase([4] * 20 + [0] * 12, [3] * 20 + [0] * 12, 3, 33, tail=48, seed=8),
    "prefill-300": RaggedCase([300, 17, 1], [0, 0, 0], 3, 4, seed=9),
}


COMPILE_FOR_HOPPER = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
assert type(kernel).__name__ == "JITFunction", type(kernel)
for consts in spec["modes"]:
    signature = {name: spec["types"].get(name, "i32") for name in kernel.arg_names}
    signature.update({name: "constexpr" for name in consts})
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    assert "ptx" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm, consts
print(f"compiled {len(spec['modes'])} modes")
"""


def assert_compiles_for_hopper(tmp_path, module: str, kernel: str, types: dict, modes: list[dict]) -> None:
    """The interpreter runs code the compiler rejects (a loop-carried value changing type, say): compile the
    kernel to PTX for sm_90 in each mode (its constexpr values), without a GPU, in a process without
    TRITON_INTERPRET. `types`: Triton types of the arguments that are not i32 scalars (pointers, floats)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    spec = json.dumps({"module": module, "kernel": kernel, "types": types, "modes": modes})
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER, spec], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and f"compiled {len(modes)} modes" in done.stdout, done.stderr[-3000:]


def assert_state_equal(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Equal where the expected state is finite; NaN exactly where a step must leave a poisoned slot alone."""
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=atol, rtol=1e-4)


def seeded_randn(*shape, dtype, seed, device="cpu") -> torch.Tensor:
    """Standard normal values drawn on the host from `seed`, then cast and moved: the same on every device."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)
