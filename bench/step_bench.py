"""The verify step of a random Qwen3.5-4B-shaped model (first --layers layers) built in memory: plain decode
and k-draft verify through ModelRunner, eager vs CUDA graph, against the bare weight-GEMM chain (every
projection of every layer + lm_head, nothing else) captured in one CUDA graph for the same tokens."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from timing import row, sync, time_ms

from specdec.models.hybrid_model import HybridModel
from specdec.models.loader import LoadedModel
from specdec.models.model_config import ModelConfig
from specdec_tools.tiny_presets import PRESETS, layer_types
from verifier_service.executor import Executor
from verifier_service.sequence import Sequence


def random_model(layers: int, device: torch.device, smoke: bool) -> LoadedModel:
    cfg = dict(PRESETS["tiny" if smoke else "qwen3.5-4b"], model_type="qwen3_5_text", num_hidden_layers=layers)
    cfg["layer_types"] = layer_types(layers, cfg["full_attention_interval"])
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        cfg.pop(key)
    config = ModelConfig.from_dict(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = HybridModel(config)
    finally:
        torch.set_default_dtype(default)
    return LoadedModel(config=config, model=model.requires_grad_(False).eval(), mtp_weights={})


def weight_chain(model: HybridModel, tokens: int, device) -> callable:
    """x [tokens, H] through every Linear weight in layer order (inputs of the right width), then lm_head."""
    hidden = model.config.hidden_size
    dtype = model.embed_tokens.weight.dtype
    weights = [m.weight for layer in model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1], device=device, dtype=dtype) for w in weights}
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)

    def chain():
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
        return F.linear(x, model.lm_head.weight)
    return chain


def prefill(executor: Executor, seqs: list[Sequence], context: int, piece: int = 1024) -> None:
    for seq in seqs:
        executor.blocks.reserve(seq, context + 8)
    per_step = max(1, piece // context)
    for i in range(0, len(seqs), per_step):
        group = seqs[i:i + per_step]
        executor.forward(group, [s.token_ids[:context] for s in group])
        for s in group:
            s.num_cached = context


def wall_ms(step, device, reps: int = 10) -> float:
    """Host wall time per step with one sync per step, as the engine runs it."""
    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        step()
        sync(device)
    return (time.perf_counter() - start) * 1e3 / reps


def step_rows(args, device: torch.device, copy_bw: float) -> list[dict]:
    loaded = random_model(args.layers, device, args.smoke)
    k, batches = args.num_drafts, args.batches
    max_seqs = max(batches)
    blocks_per_seq = -(-(args.context + 8) // 16)
    executor = Executor.build(loaded, max_seqs * blocks_per_seq, 16, max_seqs, k, device,
                              max_model_len=blocks_per_seq * 16, max_batched_tokens=1024)
    runner = executor.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    vocab = loaded.config.vocab_size
    seqs = [Sequence(i, torch.randint(1, vocab, (args.context,)).tolist(), args.context) for i in range(max_seqs)]
    prefill(executor, seqs, args.context)
    graphs, rows, decode_ms, decode_gpu_ms = runner.graphs, [], {}, {}
    for batch in batches:
        group = seqs[:batch]
        chain_ms = {}
        for tokens in (batch, batch * (k + 1)):
            chain_ms[tokens], mode = time_ms(weight_chain(loaded.model, tokens, device), device, reps=5)
            rows.append(row("step", f"b{batch} {tokens} tokens", "bare weight-GEMM chain", chain_ms[tokens], mode,
                            weight_bytes, copy_bw))
        for n, name in ((1, "decode"), (k + 1, f"verify k={k}")):
            chunks = [[7] * n for _ in group]
            for s in group:   # a verify after one that accepted all k drafts (the GDN replays k), decode after none
                s.gdn_read_offset = n - 1
            step = lambda: executor.forward(group, chunks, [n - 1] * batch, logits=[n] * batch)  # noqa: E731
            for mode_name, use in (("eager", None), ("graph", graphs)):
                if mode_name == "graph" and use is None:
                    continue
                runner.graphs = use
                ms = wall_ms(step, device)
                gpu_ms, _ = time_ms(step, device, reps=5, graph=False)
                rows.append(row("step", f"b{batch} {name}", f"ModelRunner {mode_name}", ms, "wall", weight_bytes,
                                copy_bw, note=f"{gpu_ms:.3f} ms without per-step sync; "
                                              f"x{ms / chain_ms[batch * n]:.2f} the chain"))
                if n == 1 and (mode_name == "graph" or graphs is None):
                    decode_ms[batch], decode_gpu_ms[batch] = ms, gpu_ms
            runner.graphs = graphs
    if not args.skip_draft:
        from draft_loop_bench import draft_rows
        rows += draft_rows(loaded, batches, k, args.context, device, decode_ms, decode_gpu_ms)
    return rows
