"""`specdec verifier --in-process-drafter KIND`: the drafter inside the verifier's process, with no drafter
service and no gRPC hop between them. A single-process deployment, and the control that measures what the
service split costs (`specdec bench --paths colocated gateway`). This module is where the two services meet
(the CLI composes them; neither imports the other)."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)
IN_PROCESS_KINDS = ("mtp", "ngram")


def in_process_drafter(kind: str, draft_vocab: str | None = None, draft_masks: str = "auto"):
    """A factory (loaded target, VerifierConfig) -> Drafter for `kind` (one of IN_PROCESS_KINDS). `draft_masks`
    (on | off | auto): an MTP drafter keeps grammar-constrained sequences' drafts inside their grammars
    (specdec/drafting/draft_masks.py; auto: where it drafts eagerly anyway)."""
    if kind not in IN_PROCESS_KINDS:
        raise ValueError(f"--in-process-drafter must be one of {', '.join(IN_PROCESS_KINDS)}, not {kind!r}")

    def make(loaded, config):
        from drafter_service.ngram import NgramDrafter
        if kind == "ngram":
            return NgramDrafter(config.num_drafts)
        from drafter_service.mtp.mtp_drafter import MTPDrafter
        from drafter_service.mtp.options import MTPOptions
        from specdec.drafting.draft_masks import DraftMasks
        from specdec.drafting.draft_vocab import load_draft_vocab
        if not loaded.mtp_weights:
            raise ValueError(f"{config.model_dir} has no mtp.* tensors: use --in-process-drafter ngram instead")
        max_context, blocks = config.max_context, config.kv_blocks   # as build_engine sized the verifier's
        vocab = load_draft_vocab(draft_vocab, loaded.config.vocab_size) if draft_vocab else None
        # the verify step's k + 1 tokens beyond the context: the drafter's catch-up writes them too
        options = MTPOptions(max_seqs=config.max_running, max_context=max_context + config.num_drafts + 1,
                             enforce_eager=config.enforce_eager, draft_vocab=vocab)
        masks = DraftMasks.for_folder(config.model_dir, loaded.config.vocab_size,
                                      list(loaded.config.eos_token_id)) \
            if DraftMasks.wanted(draft_masks, config.device, config.enforce_eager) else None
        drafter = MTPDrafter(loaded, config.num_drafts, num_blocks=blocks, block_size=config.block_size,
                             device=config.device, options=options, draft_masks=masks)
        if drafter.device.type == "cuda":   # the verifier's warm-up drafts with a stand-in: this one's eager shapes
            from drafter_service.mtp.warm_up import warm_up
            report = warm_up(drafter, config.max_batched_tokens)   # its steps' rows: the verifier's
            log.info("in-process mtp drafter warm-up: %d eager runs in %.1f s", report.num_runs, report.seconds)
        return drafter
    return make
