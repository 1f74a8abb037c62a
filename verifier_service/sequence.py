"""A running sequence as the verifier sees it: its tokens and where its cache lives."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int]                 # prompt + committed output
    num_prompt: int
    num_cached: int = 0                  # tokens whose KV / GDN state is in the cache
    block_table: list[int] = field(default_factory=list)
    gdn_slot: int = -1
    gdn_read_offset: int = 0             # state slot / conv column holding the state after num_cached tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]
