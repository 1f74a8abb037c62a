"""GPU checks of the drafters (run on the GPU machine: `pytest -m gpu tests/test_drafter_gpu.py`)."""
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from engine_factory import make_drafter, make_engine, random_prompts

from specdec.drafting import DraftBatch, DraftInput
from specdec.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need CUDA: run them on the GPU machine (CI deselects -m gpu)")
    from specdec_tools.tiny import make_tiny
    return str(make_tiny(tmp_path_factory.mktemp("gpu"), overrides={"vocab_size": 400}, progress=False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_draft_model_on_cuda_accepts_every_draft_of_itself(model_dir, dtype):
    from specdec.models.loader import load_model
    target = load_model(model_dir, dtype=dtype, device="cuda")
    prompts = random_prompts([3, 7, 12, 20, 5, 9, 30, 1], target.config.vocab_size)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = make_engine(target).generate(prompts, params)
    drafter = make_drafter("draft_model", target, 3, draft_model=target)
    engine = make_engine(target, drafter, 3)
    assert engine.generate(prompts, params) == expected
    assert engine.stats.drafted > 0
    if dtype == "float32":  # bf16: near-ties may flip between a 1-token and a (k+1)-token forward
        assert engine.stats.accepted == engine.stats.drafted


def test_mtp_drafter_maps_a_new_verifiers_weights(model_dir):
    """A verifier restarted on the same GPU sends new CUDA-IPC weight handles: the drafter drafts with those
    (the old ones may point at freed memory), not with the first verifier's."""
    from drafter_service.mtp.mtp_drafter import MTPDrafter
    from specdec_tools.local_stack import free_port
    from specdec.models.loader import load_drafter_weights, load_model
    from specdec.rpc.health_probe import is_serving
    from verifier_service.drafter_client import RemoteDrafter
    from verifier_service.drafter_link import DrafterLinkConfig

    loaded = load_model(model_dir, dtype="float32", device="cuda")
    cfg, port = loaded.config, free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "drafter", "--kind", "mtp", "--model", model_dir,
                             "--device", "cuda", "--dtype", "float32", "--port", str(port), "-k", "3"])
    prompt = [5, 17, 3, 99, 42, 8, 1, 250]
    hidden = torch.randn(len(prompt) - 1, cfg.hidden_size, device="cuda",
                         generator=torch.Generator("cuda").manual_seed(0))  # [n, H]
    batch = DraftBatch(1, [DraftInput(1, 0, prompt, 3)], hidden)
    embed = loaded.model.embed_tokens.weight
    permuted_head = loaded.model.lm_head.weight[torch.randperm(cfg.vocab_size, device="cuda")].contiguous()
    try:
        deadline = time.monotonic() + 300
        while not is_serving(f"127.0.0.1:{port}"):
            assert proc.poll() is None and time.monotonic() < deadline, "drafter did not start"
            time.sleep(0.2)
        drafts = []
        for lm_head in (loaded.model.lm_head.weight, permuted_head):  # two verifiers, one after the other
            link = RemoteDrafter(DrafterLinkConfig(f"127.0.0.1:{port}", 3, "cuda_ipc"), cfg.hidden_size,
                                 cfg.vocab_size, torch.float32, torch.device("cuda"), 64,
                                 {"embed_tokens": embed, "lm_head": lm_head}, cfg.model_type)
            while not link.connected:
                time.sleep(0.05)
            assert link.transport_name == "cuda_ipc"
            drafts.append(link.propose(batch).drafts[0])
            link.close()
        _, mtp, _ = load_drafter_weights(model_dir, "float32", "cuda", shared=False)
        reference = MTPDrafter.from_parts(cfg, mtp, embed, permuted_head, 3, 64, 16, "cuda").propose(batch).drafts[0]
        assert len(drafts[1]) == 3 and drafts[1] == reference and drafts[1] != drafts[0]
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_draft_loop_in_cuda_graphs_drafts_what_it_drafts_eagerly(model_dir, dtype):
    """Every call of a served workload, replayed into a drafter whose steps are captured CUDA graphs (batch
    buckets, catch-up padded to k + 1), drafts what the eager drafter drafted."""
    from test_mtp_draft_loop import replay, served_calls

    from drafter_service.mtp.mtp_drafter import MTPDrafter
    from drafter_service.mtp.options import MTPOptions
    from specdec.models.loader import load_model
    loaded = load_model(model_dir, dtype=dtype, device="cuda")
    calls = served_calls(loaded, MTPOptions(enforce_eager=True))
    graphed = MTPDrafter(loaded, 3, num_blocks=128, block_size=4, options=MTPOptions(max_seqs=5))
    assert graphed.loop.graphs is not None and graphed.loop.graphs.graphs
    results = list(replay(graphed, calls))
    differ = sum(got != want for got, want in results)
    # bf16: a padded catch-up runs GEMMs of another shape, whose rounding may flip a near-tie argmax
    assert differ == 0 if dtype == "float32" else differ <= len(results) // 20, (differ, len(results))


def test_mtp_device_steps_in_cuda_graphs_draft_what_they_draft_eagerly(model_dir):
    """Device steps (overlapped) whose prompt chunks sit beside decoding sequences: the captured drafter ingests
    the chunks' front rows and replays a batch bucket's graph, and drafts what the eager drafter drafts."""
    from test_mtp_draft_loop import assert_same_drafts, device_steps

    from drafter_service.mtp.options import MTPOptions
    from specdec.models.loader import load_model
    loaded = load_model(model_dir, dtype="float32", device="cuda")
    want_out, want, eager_split = device_steps(loaded, False, MTPOptions(max_seqs=5, enforce_eager=True))
    got_out, got, split = device_steps(loaded, False, MTPOptions(max_seqs=5))
    assert got_out == want_out and eager_split == 0 and split >= 5
    assert_same_drafts(got, want)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("kind", ["none", "mtp"])
def test_a_decode_step_synchronises_once_in_the_verifier(model_dir, kind, overlap, temperature):
    """Decode / verify steps on CUDA, greedy or sampled (top-p), read the device back once. Overlapped (the
    default; an in-process MTP drafter drafts on the device): no synchronising torch call at all, and one wait
    for the step launched before (InFlightStep.read). Synchronous (--no-overlap): the same wait for the step's own
    verdict, and an in-process MTP drafter adds its one read of the drafts. Uploads of drafts, sampling
    parameters, forced acceptance and hidden-row indices go through pinned memory and wait for nothing."""
    from specdec_tools.bench.sync_sites import site, synchronising_stacks
    from specdec.models.loader import load_model
    from verifier_service.forced_acceptance import ForcedAcceptance
    from verifier_service.in_flight import InFlightStep
    loaded = load_model(model_dir, device="cuda")
    k = 3 if kind == "mtp" else 0
    drafter = make_drafter("mtp", loaded, k) if kind == "mtp" else None
    engine = make_engine(loaded, drafter, k, forced=ForcedAcceptance(2.0, 3, seed=0, enabled=True) if k else None,
                         overlap=overlap)
    for i, prompt in enumerate(random_prompts([9, 13], 400)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=60, ignore_eos=True, temperature=temperature,
                                                           top_p=0.9, seed=i))
    for _ in range(6):   # prefill (chunks of 8) and a few decode steps
        engine.step()
    assert all(s.num_cached >= s.num_prompt for s in engine.scheduler.running)
    reads, read = [], InFlightStep.read
    InFlightStep.read = lambda self: reads.append(1) or read(self)
    try:
        sites = [site(frames) for frames in synchronising_stacks(engine.step, 5)]
    finally:
        InFlightStep.read = read
    assert len(reads) == 5   # each step's verdict, read through its pinned copy (no synchronising torch call)
    if overlap:
        assert sites == [] and (engine.overlapped_draft_steps > 0) == (k > 0)
        return
    allowed = {"mtp_drafter.py"} if drafter else set()
    assert Counter(s.split(":")[0] for s in sites) == {name: 5 for name in allowed}, sites


@pytest.mark.parametrize("verifier_device,drafter_device", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")])
def test_a_drafter_on_a_gpu_of_its_own_serves_the_plain_tokens(tmp_path, verifier_device, drafter_device):
    """The drafter service on one GPU, the verifier on another (`--drafter-device`; the verifier's `--device
    cuda:1` too): hidden states and device steps cross by CUDA IPC and a peer-to-peer copy, the shared embed_tokens
    / lm_head are copied once, the IPC events live on the verifier's GPU, and the stack serves the greedy tokens of
    plain decoding with drafts accepted."""
    import grpc

    from specdec.demo import demo_model_dir
    from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc
    from specdec_tools.local_stack import LocalStack, StackConfig
    from verifier_service.builder import VerifierConfig, build_engine
    if torch.cuda.device_count() < 2:
        pytest.fail("needs 2 GPUs: run on nvidia-h100-x2 / nvidia-h200-x2")
    prompts = [[11, 52, 7, 300, 41, 9], list(range(60, 110)), [5]]
    engine = build_engine(VerifierConfig(demo_model_dir(), device="cuda:0", num_drafts=0, max_running=4,
                                         max_context=256, kv_blocks=64))   # plain decoding
    try:
        plain = engine.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True))
    finally:
        engine.executor.close()
        del engine
        torch.cuda.empty_cache()   # the services' memory sizing sees the GPU free again
    stack = LocalStack(StackConfig(model=demo_model_dir(), drafter="mtp", num_drafts=3, device=verifier_device,
                                   dtype="float32", port=0, log_dir=str(tmp_path),
                                   verifier_args=("--draft-policy", "fixed"),
                                   drafter_args=("--device", drafter_device), startup_timeout_s=300))
    stack.start()
    served = []
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for ids in prompts:
                replies = list(stub.Generate(gateway_pb2.GenerateRequest(
                    prompt_token_ids=ids, sampling=gateway_pb2.SamplingParams(max_tokens=48, ignore_eos=True)),
                    timeout=120))
                served.append(([t for r in replies for t in r.token_ids], replies[-1].usage.accepted_tokens))
    finally:
        stack.stop()
    verifier_log = (tmp_path / "verifier.log").read_text()
    assert "transport cuda_ipc" in verifier_log and ", device steps" in verifier_log, verifier_log[-3000:]
    assert [tokens for tokens, _ in served] == plain
    assert all(accepted > 0 for _, accepted in served)
    assert f"copied the target's embed_tokens and lm_head from {verifier_device} to {drafter_device}" in (
        tmp_path / "drafter.log").read_text()
