"""Threads that run model steps on the CPU use one OpenMP thread (see specdec.step_thread), the main thread keeps
its own count: checked in the verifier's engine thread and in the drafter service's step handler."""
import threading
import time

import torch
from engine_factory import make_engine, random_prompts

from drafter_service.factory import DrafterConfig
from drafter_service.mtp.mtp_drafter import MTPDrafter
from drafter_service.server import start as start_drafter
from specdec.sampling_params import SamplingParams
from specdec.step_thread import serial_cpu_ops_in_this_thread
from verifier_service.drafter_client import RemoteDrafter
from verifier_service.drafter_link import DrafterLinkConfig
from verifier_service.engine_loop import EngineLoop


def _in_thread(fn):
    seen = []
    t = threading.Thread(target=lambda: seen.append(fn()))
    t.start()
    t.join()
    return seen[0]


def test_a_cpu_step_thread_goes_serial_and_the_main_thread_keeps_its_count():
    torch.set_num_threads(2)
    torch.ones(1 << 20).exp().sum()   # a parallel region in the main thread, as a server runs loading and warming up
    assert _in_thread(lambda: (serial_cpu_ops_in_this_thread("cuda:0"), torch.get_num_threads())[1]) == 2
    assert _in_thread(lambda: (serial_cpu_ops_in_this_thread("cpu"), torch.get_num_threads())[1]) == 1
    assert torch.get_num_threads() == 2


def test_the_engine_thread_steps_serially(tiny_model, monkeypatch):
    torch.set_num_threads(2)
    engine = make_engine(tiny_model)
    seen, step = [], engine.step
    monkeypatch.setattr(engine, "step", lambda: (seen.append(torch.get_num_threads()), step())[1])
    loop = EngineLoop(engine).start()
    done = threading.Event()
    loop.submit("r", random_prompts([5], tiny_model.config.vocab_size)[0], SamplingParams(max_tokens=3),
                lambda out: done.set() if getattr(out, "finish_reason", "x") else None)
    assert done.wait(30)
    loop.stop()
    assert seen and set(seen) == {1} and torch.get_num_threads() == 2


def test_the_drafter_handler_drafts_serially(tiny_model, tiny_dir, monkeypatch):
    torch.set_num_threads(2)
    seen = []
    for name in ("propose", "draft_on_device"):   # synchronous steps, device steps (greedy ones, here)
        real = getattr(MTPDrafter, name)
        monkeypatch.setattr(MTPDrafter, name, lambda self, batch, real=real: (seen.append(torch.get_num_threads()),
                                                                               real(self, batch))[1])
    server = start_drafter(DrafterConfig("mtp", 3, str(tiny_dir)), "127.0.0.1", 0)
    m = tiny_model.model
    remote = RemoteDrafter(DrafterLinkConfig(f"127.0.0.1:{server.port}", 3, "auto", 10.0),
                           tiny_model.config.hidden_size, tiny_model.config.vocab_size, m.embed_tokens.weight.dtype,
                           torch.device("cpu"), 512,
                           {"embed_tokens": m.embed_tokens.weight, "lm_head": m.lm_head.weight},
                           tiny_model.config.model_type)
    try:
        deadline = time.monotonic() + 30
        while not remote.connected:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine = make_engine(tiny_model, remote, 3)
        engine.generate(random_prompts([6], tiny_model.config.vocab_size), SamplingParams(max_tokens=8))
        assert engine.stats.drafted > 0 and seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        remote.close()
        server.stop(0)
