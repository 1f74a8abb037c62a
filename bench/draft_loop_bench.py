"""The MTP draft loop of a random 4B-shaped MTP head (one layer, sharing the model's embed_tokens / lm_head):
one drafter call (catch-up of k + 1 committed tokens, then k greedy draft steps) as CUDA graph and eagerly,
with the full vocabulary and with a reduced one, against the plain decode step of the same batch."""
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
               decode_ms: dict[int, float], reduced_vocab: int = 32768) -> list[dict]:
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
            rows.append(row("draft", f"b{batch} mtp k={k}", f"MTPDrafter {name}", ms, "wall",
                            k * lm_head_bytes * (len(hot) / vocab if "ids" in name else 1), None, note=note))
    return rows
