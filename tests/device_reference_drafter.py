"""A test drafter that drafts on the device (specdec.drafting.DraftsOnDevice) from known continuations: the sequence
with seq_id i follows follow(i, reference) (prompt + plain-decoding output), and at next position q its first
(q // 2) % (k + 1) drafts are the reference's tokens and the rest are wrong. So, step after step, every accepted count from 0 to k occurs,
including all k (the bonus token), each moving the next step by a different amount on the device."""
import torch

from specdec.drafting import DeviceDrafts, DeviceDraftStep, DraftBatch, DraftOutput, ModelFacts


class DeviceReferenceDrafter:
    kind = "device-reference"
    needs_hidden = False
    drafts_on_device = True

    def __init__(self, max_drafts: int, vocab_size: int, device="cpu"):
        self.max_drafts, self.vocab, self.device = max_drafts, vocab_size, device
        self.references: dict[int, list[int]] = {}
        self.table = torch.zeros(0, 0, dtype=torch.int64)
        self.facts, self.calls = ModelFacts(vocab_size=vocab_size), 0

    def follow(self, seq_id: int, reference: list[int]) -> None:
        self.references[seq_id] = reference
        width = max(map(len, self.references.values())) + self.max_drafts + 1
        table = torch.zeros(max(self.references) + 1, width, dtype=torch.int64)
        for i, ref in self.references.items():
            table[i, :len(ref)] = torch.tensor(ref)
        self.table = table.to(self.device)

    def draft_on_device(self, step: DeviceDraftStep) -> DeviceDrafts:
        self.calls += 1
        starts = torch.tensor(step.chunk_lens.cumsum() - step.chunk_lens, device=step.committed.device)
        last = starts + step.committed - 1                                                # [B]
        q = step.positions[last] + 1                                                      # [B] next token's position
        k = self.max_drafts
        cols = torch.arange(k, device=q.device)                                           # [K]
        index = (q[:, None] + 1 + cols).clamp(max=self.table.shape[1] - 1)                # [B, K]
        rows = torch.tensor(step.seq_ids, device=q.device)
        right = self.table[rows[:, None], index]                                          # [B, K]
        good = cols[None, :] < (q // 2 % (k + 1))[:, None]
        drafts = torch.where(good, right, (right + 1) % self.vocab)
        return DeviceDrafts(drafts, [min(int(n), k) for n in step.num_drafts])

    def propose(self, batch: DraftBatch) -> DraftOutput:
        """The same drafts from the host's tokens (synchronous steps): q is the newest committed token's position."""
        k, drafts = self.max_drafts, []
        for s in batch.seqs:
            q = s.start_pos + len(s.token_ids) - 1
            right = self.references[s.seq_id][q + 1:q + 1 + min(s.num_drafts, k)]
            drafts.append([t if j < q // 2 % (k + 1) else (t + 1) % self.vocab for j, t in enumerate(right)])
        return DraftOutput(drafts=drafts)

    def release(self, seq_ids):
        pass

    def clear(self):
        pass
