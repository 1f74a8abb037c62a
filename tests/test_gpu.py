"""GPU-only checks (run on the GPU machine: `pytest -m gpu`; CI deselects them)."""
import grpc
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need CUDA: run them on the GPU machine (CI deselects -m gpu)")
    from specdec_tools.tiny import make_tiny
    return str(make_tiny(tmp_path_factory.mktemp("gpu"), overrides={"vocab_size": 400}, tokenizer=True,
                         progress=False))


def test_cuda_ipc_stack_equals_plain_decoding(model_dir, tmp_path):
    from engine_factory import make_engine

    from specdec_tools.local_stack import LocalStack, StackConfig
    from specdec.models.loader import load_model
    from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc
    from specdec.sampling_params import SamplingParams
    prompts = [[5, 17, 3, 99, 42], [64, 8, 100, 3, 7, 7, 1, 250], [12, 13]]
    loaded = load_model(model_dir, dtype="float32", device="cuda")
    engine = make_engine(loaded)
    expected = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    stack = LocalStack(StackConfig(model=model_dir, drafter="mtp", device="cuda", dtype="float32", port=0,
                                   transport="cuda_ipc", log_dir=str(tmp_path), startup_timeout_s=300))
    stack.start()
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for ids, want in zip(prompts, expected):
                replies = list(stub.Generate(gateway_pb2.GenerateRequest(
                    prompt_token_ids=ids, sampling=gateway_pb2.SamplingParams(max_tokens=32, ignore_eos=True)),
                    timeout=300))
                assert [t for r in replies for t in r.token_ids] == want
                assert replies[-1].usage.draft_tokens > 0
    finally:
        stack.stop()
    assert "transport cuda_ipc" in (tmp_path / "verifier.log").read_text()
    assert "device steps" in (tmp_path / "verifier.log").read_text()   # drafts through IPC buffers and events
    assert "mapped the target's embed_tokens and lm_head over CUDA IPC" in (tmp_path / "drafter.log").read_text()


def test_cuda_ipc_tensor_roundtrip_between_processes():
    """A child process maps our buffer by handle, reads what we wrote after our event, writes back."""
    import subprocess
    import sys
    import textwrap

    from specdec.transport import cuda_ipc
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    buf = torch.arange(1000, dtype=torch.float32, device="cuda")
    e = cuda_ipc.export_tensor(buf)
    code = textwrap.dedent(f"""
        import torch
        from specdec.transport import cuda_ipc
        e = cuda_ipc.CudaIpcExport(0, {e.mem_handle!r}, {e.storage_size_bytes}, {e.storage_offset_bytes},
                                   {e.ref_counter_handle!r}, {e.ref_counter_offset}, b"")
        t = cuda_ipc.import_tensor(e, torch.float32, (1000,), 0)
        assert t.sum().item() == sum(range(1000)), t.sum().item()
        t[:10] = -1
        torch.cuda.synchronize()
        print("child ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert buf[:10].eq(-1).all() and buf[10:].eq(torch.arange(10, 1000, device="cuda", dtype=torch.float32)).all()
