"""The outputs of a fixed workload through `specdec serve`, and their digest: run it in two checkouts (each with its
own `python -m specdec`) and compare the digests to show that a change left every token as it was.

    python bench/output_digest.py --out new.json                         # this checkout, CPU, demo model
    (cd /tmp/old && PYTHONPATH=$PWD python /path/to/output_digest.py --out old.json)
    python bench/output_digest.py --compare old.json new.json            # exit 1 when a token differs

The workload: --prompts prompts of random token ids (lengths 4 to 60, seeded), each sent at once greedy and seeded
at T = 0.8 / top-p 0.9, through the gateway of a stack with --drafter (mtp | ngram | none), --max-tokens new tokens
each (ignore_eos). Only this script's gRPC stubs are imported here (specdec.rpc.v1, the same in both checkouts):
the stack runs in the checkout `python -m specdec` resolves to from the current directory.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc


def start_serve(args) -> tuple[subprocess.Popen, str, Path]:
    log = Path(tempfile.mkstemp(prefix="specdec-digest-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "specdec", "serve", "--port", "0", "--drafter", args.drafter, "--device", args.device]
    cmd += (["--model", args.model] if args.model else []) + (["--dtype", args.dtype] if args.dtype else [])
    cmd += args.serve_args
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + args.startup_timeout
    while not (found := re.search(r"specdec serving .* on (\S+:\d+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve did not start: see {log}")
        time.sleep(0.2)
    return proc, found.group(1), log


def workload(vocab: int, num_prompts: int, seed: int) -> list[tuple[str, list[int], dict]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(4, 60))] for _ in range(num_prompts)]
    jobs = []
    for i, p in enumerate(prompts):
        jobs.append((f"greedy-{i}", p, {}))
        jobs.append((f"seeded-{i}", p, {"temperature": 0.8, "top_p": 0.9, "seed": 1000 + i}))
    return jobs


def run(address: str, jobs, max_tokens: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}

    def one(name, prompt, sampling):
        with grpc.insecure_channel(address) as channel:
            replies = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
                prompt_token_ids=prompt, sampling=gateway_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                              **sampling)), timeout=600)
            out[name] = [t for r in replies for t in r.token_ids]
    threads = [threading.Thread(target=one, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(sorted(out.items()))


def digest(outputs: dict[str, list[int]]) -> str:
    return hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()[:16]


def compare(old_path: str, new_path: str) -> int:
    old, new = (json.loads(Path(p).read_text()) for p in (old_path, new_path))
    differ = sorted(k for k in old["outputs"].keys() | new["outputs"].keys()
                    if old["outputs"].get(k) != new["outputs"].get(k))
    print(f"{old_path}: {old['digest']} ({len(old['outputs'])} outputs); {new_path}: {new['digest']} "
          f"({len(new['outputs'])} outputs); differing: {len(differ)} {differ[:5]}")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=None, help="JSON of the outputs and their digest")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two --out files instead")
    p.add_argument("--drafter", default="mtp")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="more `specdec serve` flags")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    proc, address, log = start_serve(args)
    try:
        with grpc.insecure_channel(address) as channel:
            vocab = gateway_pb2_grpc.GatewayStub(channel).Info(gateway_pb2.InfoRequest(), timeout=60).vocab_size
        outputs = run(address, workload(vocab, args.prompts, args.seed), args.max_tokens)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    result = {"digest": digest(outputs), "drafter": args.drafter, "device": args.device, "outputs": outputs}
    print(f"{len(outputs)} outputs, digest {result['digest']} (drafter {args.drafter}, {args.device})")
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
