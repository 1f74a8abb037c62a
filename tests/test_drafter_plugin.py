"""Drafter plugins (entry point group `specdec.drafters`) served end to end through the real processes:
the example package is built and installed into a temporary directory with pip; a second, broken plugin is
registered through a hand-written dist-info. Neither changes this repository."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from engine_factory import make_engine

from specdec_tools.local_stack import LocalStack, StackConfig
from specdec.rpc.health_probe import is_serving
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [64, 8, 100, 3, 7, 7, 1, 250], [12]]
MAX_TOKENS = 40

JUNK_PLUGIN = '''
from specdec.drafting import DraftOutput, ModelFacts


class JunkDrafter:
    """Claims no vocabulary, then proposes ids past any vocabulary, or more drafts than asked."""
    kind, needs_hidden, facts = "junk", False, ModelFacts()

    def __init__(self, k):
        self.max_drafts, self.calls = k, 0

    def propose(self, batch):
        self.calls += 1
        if self.calls % 2:
            return DraftOutput([[10 ** 6 + i for i in range(s.num_drafts)] for s in batch.seqs])
        return DraftOutput([[1] * (s.num_drafts + 2) if s.num_drafts else [] for s in batch.seqs])

    def release(self, seq_ids):
        pass

    def clear(self):
        pass


def build(options):
    return JunkDrafter(options.max_drafts)
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    """A directory holding the example plugin (pip-installed) and the junk plugin (a bare dist-info)."""
    target, source = tmp_path_factory.mktemp("plugins"), tmp_path_factory.mktemp("src") / "drafter_plugin"
    shutil.copytree(ROOT / "examples" / "drafter_plugin", source)  # pip builds in place: keep the repository clean
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True)
    (target / "junk_drafter.py").write_text(JUNK_PLUGIN)
    info = target / "junk_drafter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: junk-drafter\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[specdec.drafters]\njunk = junk_drafter:build\n")
    return str(target)


@pytest.fixture
def with_plugins(plugin_path, monkeypatch):
    """This process and the services it starts see the plugins (LocalStack children inherit the environment)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), plugin_path]))
    monkeypatch.syspath_prepend(plugin_path)
    return plugin_path


@pytest.fixture(scope="module")
def expected(tiny_dir):
    from specdec.models.loader import load_model
    return make_engine(load_model(tiny_dir)).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


def test_cli_lists_installed_plugins(with_plugins):
    out = subprocess.run([sys.executable, "-m", "specdec", "drafter", "--list-kinds"], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[:4] == ["mtp", "draft_model", "ngram", "synthetic"] and {"bigram", "junk"} <= set(out[4:])
    from drafter_service.factory import available_kinds
    assert "bigram" in available_kinds()


def serve_and_generate(model_dir, kind, tmp_path):
    stack = LocalStack(StackConfig(model=str(model_dir), drafter=kind, num_drafts=3, port=0, transport="inline",
                                   log_dir=str(tmp_path), startup_timeout_s=120))
    stack.start()
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            info = stub.Info(gateway_pb2.InfoRequest(), timeout=10)
            outputs, usages = [], []
            sampling = gateway_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
            for ids in PROMPTS:
                replies = list(stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling),
                                             timeout=120))
                outputs.append([t for r in replies for t in r.token_ids])
                usages.append(replies[-1].usage)
        verifier = f"127.0.0.1:{stack.ports['verifier']}"
        with grpc.insecure_channel(verifier) as channel:
            stats = verifier_pb2_grpc.VerifierStub(channel).Stats(verifier_pb2.StatsRequest(), timeout=10)
        return info, outputs, usages, stats, is_serving(verifier)
    finally:
        stack.stop()


def test_example_plugin_served_end_to_end(with_plugins, tiny_dir, expected, tmp_path):
    info, outputs, usages, stats, _ = serve_and_generate(tiny_dir, "bigram", tmp_path)
    assert info.drafter_kind == "bigram" and stats.drafter_kind == "bigram"
    assert outputs == expected
    assert usages[0].draft_tokens > 0 and usages[0].accepted_tokens > 0  # the repetitive prompt drafts well
    assert "plugin drafter bigram" in (tmp_path / "drafter.log").read_text()


def test_plugin_proposing_junk_never_takes_the_verifier_down(with_plugins, tiny_dir, expected, tmp_path):
    """Out-of-vocabulary ids and surplus drafts every step: each step is a drafter failure (k = 0), output is
    plain decoding's, the verifier stays SERVING."""
    info, outputs, usages, stats, serving = serve_and_generate(tiny_dir, "junk", tmp_path)
    assert info.drafter_kind == "junk" and outputs == expected and serving
    assert stats.drafter_fallbacks > 0 and stats.draft_tokens == 0
    log = (tmp_path / "verifier.log").read_text()
    assert "outside the target's vocabulary" in log and "asked for at most" in log
