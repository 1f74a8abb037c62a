import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernel tests run under the interpreter on a CPU. The switch is read when triton.language is first
    # imported (its own @jit helpers, e.g. the combine functions of tl.max / tl.sum, are built then), and
    # transformers imports triton while test modules are collected: it must be set before any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (hf_reference, engine_factory) import by name


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The `tiny` preset (Qwen3.5 dense, 4 layers, vocab 257) with one MTP layer, from make-tiny."""
    from specdec_tools.tiny import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0, progress=False)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from specdec.models.loader import load_model
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def client(stack):
    """The official openai client on the module's `stack` (a LocalStack with --http-port)."""
    import openai
    return openai.OpenAI(base_url=stack.http_url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def stub(stack):
    """A Gateway stub on the module's `stack`."""
    import grpc
    from specdec.rpc.v1 import gateway_pb2_grpc
    with grpc.insecure_channel(stack.address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)  # same reduction order everywhere: batch mates never change a row's numbers
    yield


@pytest.fixture
def cuda() -> str:
    """The device of a `-m gpu` test: where there is none the test fails, never skips, so a GPU run cannot pass
    on a machine without one."""
    if not torch.cuda.is_available():
        pytest.fail("GPU test: run on the GPU machine")
    return "cuda"


@pytest.fixture
def nan_outputs(monkeypatch):
    """Every torch.empty made during the test is NaN-filled (floating dtypes): a kernel test sees an output
    element its kernel never wrote."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
