"""The MTP draft loop of a random 4B-shaped MTP head (one layer, sharing the model's embed_tokens / lm_head):
one drafter call (catch-up of k + 1 committed tokens, then k greedy draft steps) as CUDA graph and eagerly,
with the full vocabulary and with a reduced one, against the plain decode step of the same batch: host wall time
per call against the step's wall time, and the captured step's GPU time alone (graph replays) against the plain
step's GPU time (launched back to back, no per-step sync)."""
from __future__ import annotations

import torch
from step_bench import wall_ms
from timing import row

from drafter_service.mtp.mtp_drafter import MTPDrafter
from drafter_service.mtp.mtp_head import MTPHead
from drafter_service.mtp.options import MTPOptions
from specdec.drafting import DraftBatch, DraftInput
from specdec.models.loader import LoadedModel


def random_mtp_weights(loaded: LoadedModel, device: torch.device) -> dict[str, torch.Tensor]:
    dtype = loaded.model.embed_tokens.weight.dtype
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = MTPHead(loaded.config, 1)
    finally:
        torch.set_default_dtype(default)
    return {name: t.detach() for name, t in head.state_dict().items()}


def draft_rows(loaded: LoadedModel, batches: list[int], k: int, context: int, device: torch.device,
               decode_ms: dict[int, float], decode_gpu_ms: dict[int, float], reduced_vocab: int = 32768
               ) -> list[dict]:
    cfg, model = loaded.config, loaded.model
    weights = random_mtp_weights(loaded, device)
    vocab = cfg.vocab_size
    hot = tuple(range(0, vocab, max(1, vocab // reduced_vocab)))[:reduced_vocab]  # spread ids: forced acceptance
    variants = (("graph", MTPOptions(max_seqs=max(batches), max_context=context + 64)),
                ("eager", MTPOptions(max_seqs=max(batches), max_context=context + 64, enforce_eager=True)),
                (f"graph, {len(hot)} ids", MTPOptions(max_seqs=max(batches), max_context=context + 64,
                                                      draft_vocab=hot)))
    blocks = max(batches) * (-(-(context + 64) // 16))
    rows = []
    lm_head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    for name, options in variants:
        drafter = MTPDrafter.from_parts(cfg, weights, model.embed_tokens.weight, model.lm_head.weight, k, blocks,
                                        16, device, options)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, vocab, (max(batches), context + 1), generator=g).tolist()
        hidden = torch.randn(max(batches) * context, cfg.hidden_size, device=device, dtype=model.lm_head.weight.dtype)
        drafter.propose(DraftBatch(1, [DraftInput(i, 0, p, 0) for i, p in enumerate(prompts)], hidden))
        for batch in batches:
            step = [DraftInput(i, context, prompts[i][-1:] + [5] * (k + 1), k) for i in range(batch)]  # all accepted
            rows_in = hidden[: batch * k + batch]                                      # [B * (k + 1), H]
            ms = wall_ms(lambda: drafter.propose(DraftBatch(2, step, rows_in)), device)
            ratio = ms / decode_ms[batch] if batch in decode_ms else None
            note = f"x{ratio:.2f} the plain decode step (graph)" if ratio else ""
            moved = k * lm_head_bytes * (len(hot) / vocab if "ids" in name else 1)
            rows.append(row("draft", f"b{batch} mtp k={k}", f"MTPDrafter {name}", ms, "wall", moved, None, note=note))
            graph = replay_ms(drafter, batch, k)
            if graph is not None:
                ratio = graph / decode_gpu_ms[batch] if batch in decode_gpu_ms else None
                note = f"x{ratio:.3f} the plain decode step's GPU time" if ratio else ""
                rows.append(row("draft", f"b{batch} mtp k={k}", f"MTPDrafter {name}: graph replay alone", graph,
                                "gpu", moved, None, note=note))
    return rows


def replay_ms(drafter: MTPDrafter, batch: int, k: int, reps: int = 50) -> float | None:
    """GPU milliseconds of one replay of the drafter's captured step for this batch (catch-up of k + 1 tokens
    and k draft steps), nothing else: what the draft loop costs the device in an overlapped step."""
    graphs = drafter.loop.graphs
    if graphs is None or not torch.cuda.is_available():
        return None
    key = next((key for key in sorted(graphs.graphs) if key[0] >= batch and key[1] == k + 1), None)
    if key is None:
        return None
    graph = graphs.graphs[key][0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps
