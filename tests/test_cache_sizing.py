"""Caches sized from memory (issue 38): the budget arithmetic, the verifier's sizing on a (simulated) GPU and on
the CPU, the device defaults, the drafter's KV cache, and block tables staged by the width a step uses."""
import dataclasses

import numpy as np
import pytest
import torch

from specdec.models.batch_staging import BatchStaging, StepPlan
from specdec.models.caches import CacheShapes, ModelCaches
from specdec.models.graph_bucket import Bucket
from specdec.models.memory_budget import GIB, OUTSIDE_ALLOCATOR, DeviceMemory
from specdec.models.model_config import ModelConfig
from verifier_service import cache_sizing
from verifier_service.builder import DEVICE_LIMITS, VerifierConfig, build_engine
from verifier_service.cache_sizing import CacheRequest, size_caches


def demo_config(**changes) -> ModelConfig:
    from specdec.demo import demo_model_dir
    config = ModelConfig.from_folder(demo_model_dir())
    return dataclasses.replace(config, **changes)


def request(**changes) -> CacheRequest:
    base = CacheRequest(max_context=0, max_running=8, max_batched_tokens=512, max_drafts=3, block_size=16,
                        kv_blocks=0, gpu_memory_utilization=0.9)
    return dataclasses.replace(base, **changes)


# ---- the budget ----------------------------------------------------------------------------------------------
def test_budget_is_the_share_less_what_the_process_holds():
    memory = DeviceMemory(total=80 * GIB, free=70 * GIB, held=8 * GIB)
    room, bound = memory.cache_bytes(0.9, activations=2 * GIB)
    assert (room, bound) == (int(72 * GIB) - 8 * GIB - 2 * GIB - OUTSIDE_ALLOCATOR, "utilization")


def test_budget_never_exceeds_what_is_free():
    memory = DeviceMemory(total=80 * GIB, free=20 * GIB, held=8 * GIB)   # another process holds 52 GiB
    assert memory.cache_bytes(0.9, activations=GIB) == (20 * GIB - GIB - OUTSIDE_ALLOCATOR, "free memory")
    assert DeviceMemory(80 * GIB, GIB, 0).cache_bytes(0.9, 2 * GIB) == (0, "free memory")
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        memory.cache_bytes(1.5, 0)


def test_cache_shapes_count_what_allocate_makes():
    config = demo_config()
    caches = ModelCaches.allocate(config, num_blocks=5, block_size=16, num_gdn_slots=2, max_drafts=3)
    shapes = CacheShapes(config, 16, max_drafts=3)
    per_block = sum(t[0].numel() * t.element_size() for t in caches.kv.k + caches.kv.v)
    per_slot = sum(t[0].numel() * t.element_size()
                   for t in caches.gdn.recurrent + caches.gdn.pending + caches.gdn.conv)
    assert shapes.block_bytes(torch.float32) == per_block
    assert shapes.slot_bytes(torch.float32) == per_slot
    # the conv window is stored column by column (a step touches only the columns it reads and writes)
    assert all(c.shape[1:] == shapes.conv and c.stride(1) == 1 and c.stride(2) == shapes.conv[0]
               for c in caches.gdn.conv)


# ---- the verifier's sizing -----------------------------------------------------------------------------------
class FakeLoaded:
    """What size_caches reads of a loaded target: its config and its weights' dtype."""
    def __init__(self, config: ModelConfig, dtype=torch.bfloat16):
        self.config = config
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(2, 2, dtype=dtype)


@pytest.fixture
def gpu(monkeypatch):
    """A simulated 80 GiB GPU with 9 GiB held by weights and 1 GiB of activations per step."""
    reading = DeviceMemory(total=80 * GIB, free=70 * GIB, held=9 * GIB)
    monkeypatch.setattr(cache_sizing, "measure_activations", lambda loaded, r, device: GIB)
    monkeypatch.setattr(DeviceMemory, "read", staticmethod(lambda device: reading))
    return reading


def big_kv_config() -> ModelConfig:
    """The demo model with 256 KiB KV blocks and 262,144 positions: a pool sized by memory, not by the context."""
    return demo_config(max_position_embeddings=262144, num_key_value_heads=8, head_dim=256)


def test_gpu_pool_takes_what_the_share_leaves(gpu):
    config = big_kv_config()
    r = request(max_running=64)
    size = size_caches(r, config, torch.device("cuda"), FakeLoaded(config))
    shapes = CacheShapes(config, 16, 3)
    sampler = cache_sizing.SAMPLER_ROW_BUFFERS * 64 * 4 * config.vocab_size * 4
    room = int(0.9 * 80 * GIB) - 9 * GIB - 2 * GIB - sampler - OUTSIDE_ALLOCATOR
    assert size.num_blocks == (room - 64 * shapes.slot_bytes(torch.bfloat16)) // shapes.block_bytes(torch.bfloat16)
    assert size.num_slots == 64
    assert size.max_context == 262144                    # the model's: the pool holds far more
    assert "KV blocks" in size.summary and "64 GDN state slots" in size.summary
    small = size_caches(request(max_running=2, max_context=1000), config, torch.device("cuda"), FakeLoaded(config))
    assert small.num_blocks == 2 * 63     # never more than 2 sequences of 1000 tokens can hold (63 blocks each)


def test_gpu_pool_counts_an_in_process_drafters_kv(gpu):
    config = big_kv_config()
    alone = size_caches(request(max_running=64), config, torch.device("cuda"), FakeLoaded(config))
    with_mtp = size_caches(request(max_running=64, drafter_layers=1), config, torch.device("cuda"), FakeLoaded(config))
    layers = len(config.attention_layers)
    assert with_mtp.num_blocks == pytest.approx(alone.num_blocks * layers / (layers + 1), rel=1e-3)


def test_gpu_without_room_says_what_to_change(monkeypatch, gpu):
    monkeypatch.setattr(DeviceMemory, "read", staticmethod(lambda device: DeviceMemory(80 * GIB, 70 * GIB, 71 * GIB)))
    config = demo_config()
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        size_caches(request(), config, torch.device("cuda"), FakeLoaded(config))


def test_the_context_is_at_most_what_the_pool_holds():
    config = demo_config(max_position_embeddings=262144)
    size = size_caches(request(max_running=4), config, torch.device("cpu"), FakeLoaded(config))
    assert size.num_blocks == 4 * 4096 // 16          # the CPU's pool: 4096 tokens per running sequence
    assert size.max_context == 4 * 4096                # one sequence may hold the whole pool, not 262144
    given = size_caches(request(kv_blocks=10, max_context=100), config, torch.device("cpu"), FakeLoaded(config))
    assert (given.num_blocks, given.max_context) == (10, 100)


def test_cpu_engine_defaults():
    from specdec.demo import demo_model_dir
    engine = build_engine(VerifierConfig(model_dir=str(demo_model_dir()), num_drafts=0, warm_up=False))
    s = engine.scheduler.config
    cpu = DEVICE_LIMITS["cpu"]
    assert (s.max_running, s.max_batched_tokens, s.prefill_chunk) == (cpu["max_running"], cpu["max_batched_tokens"],
                                                                      cpu["prefill_chunk"])
    assert engine.max_len == 4096                      # the demo model's max_position_embeddings
    assert engine.executor.blocks.kv_blocks.size == cpu["max_running"] * 4096 // 16
    with pytest.raises(ValueError, match="max-running"):
        build_engine(VerifierConfig(model_dir=str(demo_model_dir()), max_running=-1, warm_up=False))
    lone = build_engine(VerifierConfig(model_dir=str(demo_model_dir()), num_drafts=0, lone_prefill_chunk=32,
                                       warm_up=False))
    assert lone.scheduler.config.lone_prefill_chunk == 32 and s.lone_prefill_chunk == 0   # off unless asked
    assert s.mixed_prefill_chunk == cpu["mixed_prefill_chunk"] == cpu["prefill_chunk"]
    mixed = build_engine(VerifierConfig(model_dir=str(demo_model_dir()), num_drafts=0, mixed_prefill_chunk=64,
                                        warm_up=False))
    assert mixed.scheduler.config.mixed_prefill_chunk == 64
    with pytest.raises(ValueError, match="mixed-prefill-chunk"):
        build_engine(VerifierConfig(model_dir=str(demo_model_dir()), mixed_prefill_chunk=-1, warm_up=False))


# ---- the drafter's KV cache ----------------------------------------------------------------------------------
def test_drafter_kv_blocks(monkeypatch):
    from drafter_service.factory import CPU_KV_BLOCKS, DRAFT_GRAPHS_ALLOWANCE, DrafterConfig, kv_blocks_for
    assert kv_blocks_for(DrafterConfig("mtp"), 65536, 0) == CPU_KV_BLOCKS
    reading = DeviceMemory(total=80 * GIB, free=10 * GIB, held=GIB // 4)
    monkeypatch.setattr(DeviceMemory, "read", staticmethod(lambda device: reading))
    c = DrafterConfig("mtp", device="cuda", gpu_memory_utilization=0.06)
    room = int(0.06 * 80 * GIB) - GIB // 4 - GIB - DRAFT_GRAPHS_ALLOWANCE - OUTSIDE_ALLOCATOR
    assert kv_blocks_for(c, 65536, GIB) == room // 65536
    with pytest.raises(ValueError, match="--kv-blocks"):
        kv_blocks_for(dataclasses.replace(c, gpu_memory_utilization=0.01), 65536, GIB)


# ---- block tables staged by the width a step uses ------------------------------------------------------------
def test_staging_copies_the_tables_a_step_uses():
    staging = BatchStaging(max_tokens=64, max_seqs=4, max_blocks=16384, block_size=16, scratch_block=99)
    plan = StepPlan.from_lists([[1, 2, 3], [4]], [0, 20], [[5], [6, 7]], [0, 1])
    staging.buffer.fill_(-7)
    batch = staging.stage(plan)
    assert batch.block_tables.tolist() == [[5, 0], [6, 7]]
    start = staging.offsets["block_tables"]
    assert (staging.buffer[start + 2 * 2:] == -7).all()      # 4 words of tables copied, not 2 x 16384
    padded = staging.stage(plan, Bucket(seqs=4, tokens=8, logit_rows=4, max_seqlen=4, max_drafts=0))
    assert padded.block_tables.shape == (4, 16384)            # the graph's fixed tensor
    assert padded.block_tables[:, :2].tolist() == [[5, 0], [6, 7], [99, 99], [99, 99]]
    narrow = StepPlan.from_lists([[1]], [3], [[8]], [2])
    assert staging.stage(narrow).block_tables.tolist() == [[8]]
    assert np.array_equal(padded.block_tables[0, :1].numpy(), [5])   # the graph's table keeps its rows until staged
