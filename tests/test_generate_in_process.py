"""`specdec generate` on a CPU runs an mtp or ngram drafter inside the verifier's process (issue 41: two processes
taking turns on a 2-core machine cost more than their exchange); `serve` keeps the drafter service unless asked,
and `--no-in-process-drafter` / `--in-process-drafter` choose. Same tokens either way."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.demo import demo_model_dir
from specdec_tools.cli import build_parser
from specdec_tools.commands.serve_cmd import stack_config

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def config(*argv: str):
    args = build_parser().parse_args(list(argv))
    return stack_config(args, port=0)


def test_generate_runs_the_drafter_in_the_verifiers_process_on_a_cpu():
    model = demo_model_dir()
    c = config("generate", "x", "--model", model, "--device", "cpu")
    assert c.drafter == "mtp" and c.drafter_in_process
    assert not config("generate", "x", "--model", model, "--device", "cpu",
                      "--no-in-process-drafter").drafter_in_process
    assert config("generate", "x", "--model", model, "--device", "cpu", "--drafter", "ngram").drafter_in_process
    assert not config("serve", "--model", model, "--device", "cpu").drafter_in_process
    assert config("serve", "--model", model, "--device", "cpu", "--in-process-drafter").drafter_in_process
    with pytest.raises(ValueError, match="runs mtp or ngram"):
        config("serve", "--model", model, "--drafter", "draft_model", "--draft-model", model, "--in-process-drafter")
    # beside tensor-parallel ranks an mtp drafter is a service (the verifier refuses it in process)
    assert not config("generate", "x", "--model", model, "--device", "cpu", "--tensor-parallel-size", "2"
                      ).drafter_in_process
    with pytest.raises(ValueError, match="tensor-parallel"):
        config("generate", "x", "--model", model, "--device", "cpu", "--tensor-parallel-size", "2",
               "--in-process-drafter")


def test_the_stack_passes_the_drafter_to_the_verifier_and_starts_no_drafter_service():
    from specdec_tools.local_stack import LocalStack
    c = config("generate", "x", "--model", demo_model_dir(), "--device", "cpu", "-k", "2", "--enforce-eager")
    stack = LocalStack(c)
    spawned = {}
    stack._spawn = lambda name, args: spawned.setdefault(name, args)   # no process: the commands only
    stack._wait_healthy = lambda name: None
    stack.start()
    assert set(spawned) == {"verifier", "gateway"}
    verifier = spawned["verifier"]
    at = verifier.index("--in-process-drafter")
    assert verifier[at + 1: at + 4] == ["mtp", "-k", "2"] and "--drafter-address" not in verifier


def generate(*flags: str) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "specdec", "generate", "def fibonacci(n):", "--max-tokens", "24",
                           *flags], capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


def test_generate_gives_the_same_tokens_with_the_drafter_in_process_or_as_a_service():
    text_in, log_in = generate()
    text_svc, log_svc = generate("--no-in-process-drafter")
    assert "mtp drafter in the verifier's process" in log_in and "in the verifier's process" not in log_svc
    assert text_in == text_svc and text_in.strip()
    usage = [line for line in log_in.splitlines() if line.startswith("[usage")]
    assert usage and usage == [line for line in log_svc.splitlines() if line.startswith("[usage")]
    assert " 0 accepted" not in usage[0]
    text_plain, log_plain = generate("--no-speculation")   # the per-request switch, from the terminal
    assert text_plain == text_in
    assert "; 0 drafted, 0 accepted (0%); 23 verify steps;" in log_plain, log_plain[-1000:]
