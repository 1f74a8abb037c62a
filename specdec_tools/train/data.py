"""Windows of a token stream: seeded random windows for training, fixed evenly spaced ones for evaluation."""
from __future__ import annotations

import torch


class WindowSampler:
    """Random windows of `window` consecutive tokens from `stream` (on `device`), from a seeded generator:
    the same seed gives the same batches in the same order."""

    def __init__(self, stream: torch.Tensor, window: int, device: torch.device, seed: int):
        if stream.numel() < window:
            raise ValueError(f"training stream has {stream.numel()} tokens, fewer than one window of {window}")
        self.stream = stream.to(device)
        self.window = window
        self.offsets = torch.arange(window, device=device)
        self.generator = torch.Generator().manual_seed(seed)  # CPU generator: identical on every device

    def sample(self, batch_size: int) -> torch.Tensor:
        high = self.stream.numel() - self.window + 1
        starts = torch.randint(0, high, (batch_size, 1), generator=self.generator)
        return self.stream[starts.to(self.stream.device) + self.offsets]


def fixed_windows(stream: torch.Tensor, window: int, max_windows: int) -> torch.Tensor:
    """Up to `max_windows` windows [N, window] with evenly spaced starts covering the whole stream
    (non-overlapping when the stream holds fewer than max_windows windows). Deterministic."""
    if stream.numel() < window:
        raise ValueError(f"evaluation stream has {stream.numel()} tokens, fewer than one window of {window}")
    count = max(1, min(max_windows, stream.numel() // window))
    last = stream.numel() - window
    starts = [round(i * last / max(count - 1, 1)) for i in range(count)] if count > 1 else [0]
    return torch.stack([stream[s:s + window] for s in starts])
