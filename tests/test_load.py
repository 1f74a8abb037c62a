"""64 concurrent streaming clients against the CPU stack (issue 13, load): every request completes with its
plain-decoding output, nothing leaks (KV blocks, GDN slots, requests in flight, process memory within a bound),
health answers within 1 s throughout. The CI version is small; the slow one is the figure of the report
(`python bench/load_test.py` runs the same thing as a script)."""
import sys

import pytest
from reliability_stack import REPO, references, start_stack, tiny_with_tokenizer

from specdec.demo import demo_model_dir

sys.path.append(str(REPO / "bench"))   # after the packages: bench/kernels.py must not hide kernels/
from load_test import leaks, make_jobs, random_prompts, rss_mb, run_load  # noqa: E402

CLIENTS = 64
RSS_GROWTH_MB = 150  # per service, from after a warm-up round to the end; measured: < 15 MB at 128 requests


def load_round(model_dir, tmp_path, drafter, num_prompts, num_requests, max_tokens, vocab):
    prompts = random_prompts(num_prompts, vocab, seed=1)
    expected = references(model_dir, prompts, max_tokens)
    stack = start_stack(model_dir, tmp_path, drafter=drafter)
    try:
        verifier = f"127.0.0.1:{stack.ports['verifier']}"
        warm = run_load(stack.address, make_jobs(prompts, expected, CLIENTS), CLIENTS, max_tokens)
        assert warm.ok, warm.summary()
        rss = {name: rss_mb(p.pid) for name, p in stack.procs.items()}
        report = run_load(stack.address, make_jobs(prompts, expected, num_requests), CLIENTS, max_tokens,
                          [stack.address, verifier])
        print(report.summary())
        assert not report.failures, report.failures[:5]
        assert not report.mismatches and len(report.latencies_s) == num_requests
        assert not report.health_failures and report.health_probes > 0, report.summary()
        assert leaks(verifier) == []
        for name, p in stack.procs.items():
            grown = rss_mb(p.pid) - rss[name]
            print(f"{name} RSS {rss[name]:.0f} MB, grew {grown:+.0f} MB")
            assert grown < RSS_GROWTH_MB, f"{name} RSS grew {grown:.0f} MB"
        return report
    finally:
        stack.stop()


@pytest.mark.timeout(400)
def test_64_clients_small(tmp_path):
    model_dir = tiny_with_tokenizer(tmp_path / "model")
    load_round(model_dir, tmp_path, "ngram", num_prompts=16, num_requests=128, max_tokens=12, vocab=400)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_64_clients_demo_model_256_requests(tmp_path):
    load_round(demo_model_dir(), tmp_path, "mtp", num_prompts=32, num_requests=256, max_tokens=16, vocab=4096)
