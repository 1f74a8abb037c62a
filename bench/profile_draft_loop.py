"""Where the MTP draft loop's time goes at batch 1: torch.profiler over drafter calls of a random 4B-shaped
MTP head (graphs on), full vocabulary and a 32k-id one. Prints the wall time per call and the top CPU / CUDA
entries. Run from bench/ on the GPU machine: python3 profile_draft_loop.py"""
from __future__ import annotations

import time

import torch
from draft_loop_bench import random_mtp_weights
from step_bench import random_model
from torch.profiler import ProfilerActivity, profile

from drafter_service.mtp.mtp_drafter import MTPDrafter
from drafter_service.mtp.options import MTPOptions
from specdec.drafting import DraftBatch, DraftInput


def main() -> None:
    device = torch.device("cuda")
    loaded = random_model(1, device, smoke=False)
    cfg, model, k, context = loaded.config, loaded.model, 3, 128
    weights = random_mtp_weights(loaded, device)
    hot = tuple(range(0, cfg.vocab_size, cfg.vocab_size // 32768))[:32768]
    for name, vocab in (("full vocabulary", None), ("32768 ids", hot)):
        drafter = MTPDrafter.from_parts(cfg, weights, model.embed_tokens.weight, model.lm_head.weight, k, 64, 16,
                                        device, MTPOptions(max_seqs=1, max_context=context + 64, draft_vocab=vocab))
        prompt = list(range(1, context + 2))
        hidden = torch.randn(context, cfg.hidden_size, device=device, dtype=model.lm_head.weight.dtype)
        drafter.propose(DraftBatch(1, [DraftInput(0, 0, prompt, 0)], hidden))
        batch = DraftBatch(2, [DraftInput(0, context, [prompt[-1]] + [5] * (k + 1), k)], hidden[: k + 1])
        for _ in range(5):
            drafter.propose(batch)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            drafter.propose(batch)
        wall = (time.perf_counter() - start) * 1e3 / 50
        replay_start, replay_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph = next(iter(drafter.loop.graphs.graphs.values()))[0]
        replay_start.record()
        for _ in range(50):
            graph.replay()
        replay_end.record()
        replay_end.synchronize()
        print(f"== {name}: {wall:.3f} ms per propose call (wall), {replay_start.elapsed_time(replay_end) / 50:.3f} ms "
              f"per graph replay alone (GPU)")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                drafter.propose(batch)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
