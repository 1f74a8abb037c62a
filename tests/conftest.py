import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # CPU CI: Triton kernels run in the interpreter. It is read when a @triton.jit function is defined (also
    # triton.language's own), so it must be set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (hf_reference, engine_factory) import by name


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The `tiny` preset (Qwen3.5 dense, 4 layers, vocab 257) with one MTP layer, from make-tiny."""
    from specdec.tiny import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0, progress=False)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from specdec.models.loader import load_model
    return load_model(tiny_dir)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.set_num_threads(1)  # same reduction order everywhere: batch mates never change a row's numbers
    yield
