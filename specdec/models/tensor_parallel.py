"""Tensor parallelism: which slice of each weight a rank holds, and the collectives that join the slices.

N ranks split every layer by heads (Megatron's layout): attention q heads (a kv head is replicated on the ranks
whose q heads read it when there are fewer kv heads than ranks), GDN key and value heads with their conv channels
and state, the MLP's intermediate columns, each MoE expert's intermediate columns (every rank holds every
expert, and the router runs replicated), and the vocabulary of the embedding and lm_head (padded to a multiple of
N). Column-parallel projections (q/k/v, in_proj, gate/up) need no communication; the row-parallel ones after them
(o_proj, out_proj, down) leave partial sums that one all-reduce per mixer and one per MLP add up, and the
embedding's rows outside a rank's vocabulary read zero and are summed the same way:

    y = Σ_r  x[:, cols_r] · W[rows, cols_r]ᵀ        (o_proj / out_proj / down_proj, r over ranks)
    logits = concat_r  hidden · lm_head[vocab_r]ᵀ   (all-gather, then the padding columns dropped)

A rank's model is HybridModel over `local_config` (head and column counts divided by N), so its caches, its
kernels and its CUDA graphs are those of a smaller model of the same family; `shard_rows` says which rows (or
columns) of each checkpoint tensor it reads.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .model_config import ModelConfig

log = logging.getLogger(__name__)


class OneShotAllReduce:
    """A sum over the ranks' GPUs in one kernel (torch's symmetric memory, without NVLink multicast): each rank
    copies x into its slice of a buffer every rank has mapped, the ranks meet at a barrier of signal flags, and each
    reads all N slices over NVLink / PCIe peer access and adds them:

        x_r ← Σ_s buf_s[:n]        (buf_r[:n] ← x_r first; one launch, no NCCL proxy, graph-capturable)

    For the small messages of decode and verify steps this beats NCCL's ring (bench/README: all-reduce); larger
    ones, and dtypes other than the buffer's, go to NCCL. The kernel ends with a second barrier, so the next call
    may overwrite the buffer while no rank still reads it. Two steps, each on every rank: allocate (__init__), then
    `join` (the rendezvous that maps the other ranks' buffers); torch's kernel sums bf16 and fp32 only."""

    DTYPES = (torch.bfloat16, torch.float32)

    def __init__(self, max_bytes: int, dtype: torch.dtype, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem
        if dtype not in self.DTYPES:
            raise ValueError(f"the one-shot all-reduce sums bfloat16 and float32, not {dtype}")
        self.dtype, self.group = dtype, dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)   # [max_numel]

    @classmethod
    def set_up(cls, max_bytes: int, dtype: torch.dtype, device: torch.device, rank: int,
               host: dist.ProcessGroup) -> OneShotAllReduce | None:
        """Every rank's one-shot all-reduce, or None on every rank: a rank whose allocation or rendezvous failed
        makes all fall back to NCCL (agreed over the `host` group: a rank summing one way and another the other
        would wait for each other forever); None for dtypes the kernel does not sum."""
        if dtype not in cls.DTYPES:
            if rank == 0:
                log.info("all-reduce: NCCL sums every message (the one-shot kernel sums bf16 and fp32, not %s)", dtype)
            return None
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"   # read by torch's rendezvous: no multicast object
        one_shot, problem = None, ""
        try:
            one_shot = cls(max_bytes, dtype, device)
        except (RuntimeError, ImportError, AttributeError) as e:
            problem = f"{type(e).__name__}: {e}"
        if _on_all_ranks(not problem, host) and one_shot is not None:
            try:
                one_shot.join()
            except (RuntimeError, AttributeError) as e:
                problem = f"{type(e).__name__}: {e}"
            if _on_all_ranks(not problem, host):
                if rank == 0:
                    log.info("all-reduce: one-shot over symmetric memory up to %d KiB (%s), NCCL above",
                             max_bytes >> 10, dtype)
                return one_shot
        log.warning("rank %d: one-shot all-reduce unavailable (%s): NCCL sums every message", rank,
                    problem or "another rank could not set it up")
        return None

    def join(self) -> None:
        """Map every rank's buffer (collective). Without NVLink multicast: the caller sets torch's
        TORCH_SYMM_MEM_DISABLE_MULTICAST=1 first, since the rendezvous would otherwise create a multicast object
        on GPUs that offer it (this kernel never reads it)."""
        from torch.distributed import _symmetric_memory as symm_mem
        symm_mem.rendezvous(self.buffer, self.group)

    def fits(self, x: torch.Tensor) -> bool:
        """x is of the buffer's dtype, fits it, is contiguous and a whole number of the kernel's 16-byte vectors.
        Shapes only: every rank must decide alike (one rank in NCCL, another here, would wait forever)."""
        return (x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.buffer.numel()
                and x.numel() * x.element_size() % 16 == 0)

    def __call__(self, x: torch.Tensor) -> None:
        flat = x.view(-1)                                                                         # [numel]
        if flat.data_ptr() % 16:   # a view at an odd offset: the kernel reads and writes aligned 16-byte vectors
            flat.copy_(torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffer[:flat.numel()], flat.clone(), "sum",
                                                                   self.group))
            return
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buffer[:flat.numel()], flat, "sum", self.group, flat)


def _on_all_ranks(ok: bool, host: dist.ProcessGroup) -> bool:
    """Whether `ok` holds on every rank (a collective over the host group)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=host)
    return bool(flag.item())


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1                   # the collectives run over the default process group
    one_shot: OneShotAllReduce | None = dataclasses.field(default=None, compare=False)   # None: NCCL / gloo only

    @property
    def active(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (a no-op at size 1)."""
        if self.one_shot is not None and self.one_shot.fits(x):
            self.one_shot(x)
        elif self.active:
            dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on every rank → [N, size · C], rank r's columns at r · C."""
        if not self.active:
            return x
        if x.is_cuda:
            out = x.new_empty(self.size * x.shape[0], x.shape[1])                     # [size · N, C]
            dist.all_gather_into_tensor(out, x.contiguous())
            return out.view(self.size, x.shape[0], x.shape[1]).permute(1, 0, 2).reshape(x.shape[0], -1)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's x into every rank's x, in place."""
        if self.active:
            dist.broadcast(x, src=0)

    # ---- how the heads and columns split --------------------------------------------------
    def split(self, count: int, what: str) -> range:
        """This rank's contiguous share of `count` heads / columns (count divisible by the ranks)."""
        if count % self.size:
            raise ValueError(f"{what}: {count} does not split over {self.size} tensor-parallel ranks")
        share = count // self.size
        return range(self.rank * share, (self.rank + 1) * share)

    def kv_heads(self, config: ModelConfig) -> range:
        """The kv heads this rank's q heads read: its share, or the one kv head of them all (replicated)."""
        kv = config.num_key_value_heads
        if kv >= self.size:
            return self.split(kv, "num_key_value_heads")
        if self.size % kv:
            raise ValueError(f"num_key_value_heads {kv} neither splits over nor divides {self.size} ranks")
        head = self.split(config.num_attention_heads, "num_attention_heads").start // (
            config.num_attention_heads // kv)
        return range(head, head + 1)

    def vocab_rows(self, vocab_size: int) -> range:
        """This rank's rows of the embedding / lm_head: the vocabulary padded to a multiple of the ranks."""
        share = -(-vocab_size // self.size)
        return range(self.rank * share, (self.rank + 1) * share)


def local_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The config of one rank's shard: a model of the same family with 1/N of the heads and columns."""
    if not tp.active:
        return config
    dense = any(not config.layer_is_moe(i) for i in range(config.num_hidden_layers))
    for name in ("num_attention_heads", "linear_num_key_heads", "linear_num_value_heads"):
        tp.split(getattr(config, name), name)
    tp.kv_heads(config)
    moe = {}
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):   # 0 in a dense model
        moe[name] = len(tp.split(getattr(config, name), name))
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // tp.size,
        num_key_value_heads=len(tp.kv_heads(config)),
        linear_num_key_heads=config.linear_num_key_heads // tp.size,
        linear_num_value_heads=config.linear_num_value_heads // tp.size,
        intermediate_size=len(tp.split(config.intermediate_size, "intermediate_size")) if dense
        else config.intermediate_size, **moe)   # an all-MoE model's intermediate_size is unused


Rows = list[range]     # ranges of indices along one dimension, concatenated in order


@dataclass(frozen=True)
class Shard:
    """Which part of a tensor a rank holds: the index ranges `rows` along `dim`, concatenated."""
    dim: int
    rows: Rows


def _heads(heads: range, width: int) -> range:
    return range(heads.start * width, heads.stop * width)


def shard_of(config: ModelConfig, tp: TensorParallel, name: str) -> Shard | None:
    """This rank's part of the canonical tensor `name` (or of the checkpoint tensor it comes from, for the per-expert
    and Qwen3-Next fused ones); None: replicated (norms, the router, the shared expert's gate)."""
    if not tp.active:
        return None
    c = config
    vocab = tp.vocab_rows(c.vocab_size)
    q_heads = tp.split(c.num_attention_heads, "num_attention_heads")
    hk = tp.split(c.linear_num_key_heads, "linear_num_key_heads")
    hv = tp.split(c.linear_num_value_heads, "linear_num_value_heads")
    dk, dv, key_dim = c.linear_key_head_dim, c.linear_value_head_dim, c.gdn_key_dim
    qkv = [range(hk.start * dk, hk.stop * dk), range(key_dim + hk.start * dk, key_dim + hk.stop * dk),
           range(2 * key_dim + hv.start * dv, 2 * key_dim + hv.stop * dv)]     # [q | k | v] channels
    tail = ".".join(name.rsplit(".", 2)[-2:])     # e.g. "q_proj.weight", "linear_attn.A_log"
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return Shard(0, [vocab])
    if tail == "q_proj.weight":
        return Shard(0, [_heads(q_heads, 2 * c.head_dim)])
    if tail in ("k_proj.weight", "v_proj.weight"):
        return Shard(0, [_heads(tp.kv_heads(c), c.head_dim)])
    if tail == "o_proj.weight":
        return Shard(1, [_heads(q_heads, c.head_dim)])
    if tail in ("in_proj_qkv.weight", "linear_attn.conv1d_weight", "conv1d.weight"):
        return Shard(0, qkv)
    if tail == "in_proj_qkvz.weight":    # Qwen3-Next: rows grouped by key head
        per_head = 2 * c.linear_key_head_dim + 2 * c.linear_value_head_dim * (
            c.linear_num_value_heads // c.linear_num_key_heads)
        return Shard(0, [_heads(hk, per_head)])
    if tail == "in_proj_ba.weight":
        return Shard(0, [_heads(hk, 2 * (c.linear_num_value_heads // c.linear_num_key_heads))])
    if tail == "in_proj_z.weight":
        return Shard(0, [_heads(hv, c.linear_value_head_dim)])
    if tail in ("in_proj_b.weight", "in_proj_a.weight", "linear_attn.dt_bias", "linear_attn.A_log"):
        return Shard(0, [hv])
    if tail == "out_proj.weight":
        return Shard(1, [_heads(hv, c.linear_value_head_dim)])
    inter = _intermediate(c, tp, name)
    if inter is None:
        return None
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return Shard(0, [inter])
    if name.endswith("down_proj.weight"):
        return Shard(1, [inter])
    if name.endswith(("experts_gate_up", "experts.gate_up_proj")):   # [E, 2I, H]: gate rows, then up rows
        size = c.moe_intermediate_size
        return Shard(1, [inter, range(size + inter.start, size + inter.stop)])
    if name.endswith(("experts_down", "experts.down_proj")):         # [E, H, I]
        return Shard(2, [inter])
    return None


def _intermediate(c: ModelConfig, tp: TensorParallel, name: str) -> range | None:
    if ".shared_expert." in name:
        return tp.split(c.shared_expert_intermediate_size, "shared_expert_intermediate_size")
    if ".experts" in name:
        return tp.split(c.moe_intermediate_size, "moe_intermediate_size")
    if ".mlp." in name:
        return tp.split(c.intermediate_size, "intermediate_size")
    return None


def take(t: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """`shard` of a full tensor (rows past its end, the vocabulary's padding, read as zeros)."""
    if shard is None:
        return t
    parts = []
    for rows in shard.rows:
        size = t.shape[shard.dim]
        part = t.narrow(shard.dim, min(rows.start, size), max(0, min(rows.stop, size) - rows.start))
        missing = len(rows) - part.shape[shard.dim]
        if missing:
            pad = list(part.shape)
            pad[shard.dim] = missing
            part = torch.cat([part, part.new_zeros(pad)], dim=shard.dim)
        parts.append(part)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
