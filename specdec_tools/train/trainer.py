"""The optimisation loop: AdamW, linear warm-up + cosine decay, gradient clipping, a wall-clock budget.

Loss = next-token CE + mtp_weight * MTP CE. With a time budget the cosine schedule follows whichever is
further along, steps or wall-clock time, so a run stopped by the budget still ends at the minimum rate.
Host syncs happen only at log / eval steps.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .data import WindowSampler
from .model import DemoModel


@dataclass
class TrainSettings:
    steps: int = 3000
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 150
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    max_seconds: float | None = None
    log_every: int = 50
    eval_every: int = 0
    final_window: int = 50  # the reported final train loss is the mean of this many last steps


@dataclass
class TrainResult:
    steps_done: int = 0
    train_seconds: float = 0.0
    eval_seconds: float = 0.0
    tokens_seen: int = 0
    stopped_early: bool = False
    final_train_loss: float = float("nan")
    final_train_mtp_loss: float = float("nan")
    history: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)


def learning_rate(s: TrainSettings, step: int, elapsed: float) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    if s.max_seconds:
        progress = max(progress, elapsed / s.max_seconds)
    progress = min(1.0, progress)
    low = s.lr * s.min_lr_ratio
    return low + (s.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: DemoModel, s: TrainSettings, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices (ndim >= 2, the tied embedding included); none on norms, A_log, dt_bias."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, fused=device.type == "cuda")


class Trainer:
    def __init__(self, model: DemoModel, sampler: WindowSampler, settings: TrainSettings, autocast,
                 evaluate: Callable[[], tuple[float, float]] | None = None, log: Callable[[str], None] = print):
        self.model, self.sampler, self.s, self.autocast = model, sampler, settings, autocast
        self.evaluate, self.log = evaluate, log
        self.device = next(model.parameters()).device
        self.optimizer = make_optimizer(model, settings, self.device)
        self.recent = deque(maxlen=max(settings.final_window, settings.log_every, 1))

    def step(self, step: int, elapsed: float) -> float:
        lr = learning_rate(self.s, step, elapsed)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        windows = self.sampler.sample(self.s.batch_size)
        with self.autocast():
            next_loss, mtp_loss = self.model(windows)
        loss = next_loss + self.s.mtp_weight * mtp_loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.grad_clip)
        self.optimizer.step()
        self.recent.append(torch.stack([next_loss.detach(), mtp_loss.detach()]))
        return lr

    def run(self) -> TrainResult:
        s, r = self.s, TrainResult()
        tokens_per_step = s.batch_size * (self.sampler.window - 2)
        self.model.train()
        start = mark = time.perf_counter()
        mark_step = 0
        for step in range(s.steps):
            elapsed = time.perf_counter() - start  # the budget counts periodic evaluations too
            if s.max_seconds and elapsed >= s.max_seconds:
                r.stopped_early = True
                self.log(f"time budget of {s.max_seconds / 60:.1f} min reached after {step} steps; stopping")
                break
            lr = self.step(step, elapsed)
            r.steps_done = step + 1
            done = r.steps_done == s.steps
            if s.log_every and (r.steps_done % s.log_every == 0 or done or r.steps_done == 1):
                now = time.perf_counter()
                losses = self._mean_recent(r.steps_done - mark_step)
                rate = tokens_per_step * (r.steps_done - mark_step) / max(now - mark, 1e-9)
                row = {"step": r.steps_done, "loss": losses[0], "mtp_loss": losses[1], "lr": lr,
                       "tokens_per_s": rate, "elapsed_s": now - start}
                r.history.append(row)
                self.log(f"step {row['step']:5d}  loss {row['loss']:.4f}  mtp {row['mtp_loss']:.4f}  "
                         f"lr {lr:.2e}  {rate:,.0f} tok/s  {row['elapsed_s']:.0f}s")
                mark, mark_step = time.perf_counter(), r.steps_done
            if self.evaluate and s.eval_every and r.steps_done % s.eval_every == 0 and not done:
                mark += self._periodic_eval(r)  # keep evaluation time out of the tokens/s figure
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        r.train_seconds = time.perf_counter() - start - r.eval_seconds
        r.tokens_seen = r.steps_done * tokens_per_step
        r.final_train_loss, r.final_train_mtp_loss = self._mean_recent(s.final_window)
        return r

    def _mean_recent(self, count: int) -> tuple[float, float]:
        if not self.recent:
            return float("nan"), float("nan")
        last = list(self.recent)[-max(1, count):]
        next_mean, mtp_mean = torch.stack(last).float().mean(0).tolist()
        return next_mean, mtp_mean

    def _periodic_eval(self, r: TrainResult) -> float:
        """Evaluate on the held-out subset, record and log it; returns the seconds it took."""
        t0 = time.perf_counter()
        held, held_mtp = self.evaluate()
        spent = time.perf_counter() - t0
        r.eval_seconds += spent
        r.evals.append({"step": r.steps_done, "held_out_loss": held, "held_out_mtp_loss": held_mtp})
        self.log(f"eval  step {r.steps_done:5d}  held-out loss {held:.4f}  mtp {held_mtp:.4f}  ({spent:.1f}s)")
        return spent
