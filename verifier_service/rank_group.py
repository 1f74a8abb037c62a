"""Tensor-parallel ranks: the verifier process is rank 0; it starts ranks 1..N-1 as its child processes, each of
which loads its shard of the target (tensor_parallel.py), allocates its caches and captures its CUDA graphs, then
runs every step rank 0 tells it, in the same order:

    rank 0   executor.forward: plan the step → send StepMessage → run its shard → sample (rank 0 only)
    rank r   receive StepMessage → its cache ops (GDN slots reset or restored, KV blocks copied) → run its shard (the
             collectives meet rank 0's) → save the states of prefix checkpoints

The message crosses a gloo group on the host (step_message.py); the collectives inside the step use NCCL on GPUs
(rank r on cuda:r) and gloo on the CPU. A step whose inputs rank 0 rewrote on the device from an unread verdict
(overlapped steps) broadcasts them first (ModelRunner.run's share_inputs).
A rank r > 0 logs its host time per step (its wait for rank 0's message, its launch of the step:
rank_step_stats.py) every RankSpec.stats_every_s seconds of steps and at stop.

A rank that dies before joining is seen at once (rank 0 waits for the ranks at the store, checking they live). A
rank that exits later is seen at the next step, or by the step it breaks (gloo raises): the step raises RankLost,
which fails the requests in flight and turns the verifier's health NOT_SERVING (engine_loop.py). A serving verifier
also watches its ranks (`watch`): REPORTED_GRACE_S after that it exits with code 3, for its supervisor to start it
again with every rank (`specdec serve` and compose's restart do); a collective whose peer is gone may instead wait
forever (NCCL), so with no RankLost raised within STUCK_AFTER_S of the loss it exits the same way. A rank dies with
rank 0 (PR_SET_PDEATHSIG: with the thread that started it, the main thread here) and ignores SIGINT (a terminal's
Ctrl-C reaches the whole process group: rank 0 stops the ranks itself).
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from specdec.models.loader import load_model, parse_dtype
from specdec.models.tensor_parallel import OneShotAllReduce, TensorParallel
from specdec.process_guard import die_with_parent
from specdec.transport.host import free_port

from .block_manager import CacheOps
from .model_runner import ModelRunner
from .rank_step_stats import RankStepStats
from .step_message import PER_SEQ, MessageChannel, StepMessage

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0   # a rank loads its shard and captures its graphs within this
STUCK_AFTER_S = 10.0      # a rank exited and no step has raised RankLost since: rank 0 waits in a collective
REPORTED_GRACE_S = 2.0    # a step raised RankLost: the failed requests reach their clients, then the exit
TEARDOWN_S = 10.0
ONE_SHOT_MAX_BYTES = 2 << 20   # a message up to this size takes the one-shot all-reduce (--all-reduce one-shot)


class RankLost(RuntimeError):
    """A tensor-parallel rank exited: the verifier cannot run another step."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds: its shard of the model in model_dir, and a runner of these sizes."""
    model_dir: str
    size: int
    device: str = "cpu"                  # "cuda": rank r on cuda:r
    dtype: str = "float32"
    load_format: str = "safetensors"
    runner: dict = field(default_factory=dict)   # ModelRunner's keyword arguments (num_blocks, block_size, ...)
    message_size: int = 0                # words of the step message; 0: message_words' default
    quantization: str = "none"           # "fp8": each rank rounds its own slices through FP8 blocks (loader.py)
    stats_every_s: float = 60.0          # a rank r > 0 logs its host time per step this often, and at stop (0: never)
    all_reduce: str = "one-shot"         # on GPUs: "one-shot" (symmetric memory) for small messages, or "nccl" only

    @property
    def message_words(self) -> int:
        """The step message's fixed size: a step of the token budget and every sequence with 64 blocks fits."""
        seqs = self.runner.get("max_seqs", 16)
        return self.message_size or self.runner.get("max_batched_tokens", 512) + seqs * (len(PER_SEQ) + 64) + seqs

    def device_of(self, rank: int) -> str:
        return f"cuda:{rank}" if torch.device(self.device).type == "cuda" else "cpu"


def _join(spec: RankSpec, rank: int, port: int, check_alive=None) -> tuple[TensorParallel, object]:
    """Join the group: (the device collectives' TensorParallel, the host group that carries the messages). Rank 0
    waits for the others to reach the store calling `check_alive` (a rank that died starting raises RankLost there,
    where the store would wait START_TIMEOUT_S for it)."""
    device = torch.device(spec.device_of(rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, spec.size, is_master=rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    if rank:
        store.set(f"specdec-rank{rank}", "started")
    else:
        waiting = [f"specdec-rank{r}" for r in range(1, spec.size)]
        while not store.check(waiting):
            check_alive()
            time.sleep(0.05)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=spec.size, device_id=device if device.type == "cuda" else None)
    host = dist.new_group(backend="gloo")
    tp = TensorParallel(rank, spec.size, one_shot=_one_shot(spec, device, rank, host))
    tp.all_reduce(torch.zeros(1, device=device))   # the communicators exist before any graph captures them
    tp.all_reduce(torch.zeros(8, dtype=parse_dtype(spec.dtype), device=device))   # (and the one-shot's buffer)
    return tp, host


def _one_shot(spec: RankSpec, device: torch.device, rank: int, host) -> OneShotAllReduce | None:
    """The one-shot all-reduce of small messages on GPUs (--all-reduce one-shot), None where NCCL does all."""
    if device.type != "cuda" or spec.all_reduce != "one-shot":
        return None
    return OneShotAllReduce.set_up(ONE_SHOT_MAX_BYTES, parse_dtype(spec.dtype), device, rank, host)


def _build_runner(spec: RankSpec, tp: TensorParallel) -> ModelRunner:
    device = spec.device_of(tp.rank)
    loaded = load_model(spec.model_dir, spec.dtype, device, tp=tp, load_format=spec.load_format,
                        progress=False if tp.rank else None, quantization=spec.quantization)
    return ModelRunner(loaded, device=device, **spec.runner)


def rank_main(spec: RankSpec, rank: int, port: int, parent: int) -> None:
    """A rank r > 0: build, then run rank 0's steps until told to stop (or until rank 0, pid `parent`, is gone)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent, signal.SIGKILL)   # a killed rank 0 must not leave it holding its GPU
    tp, host = _join(spec, rank, port)
    runner = _build_runner(spec, tp)
    channel = MessageChannel(host, spec.message_words)
    log.info("rank %d of %d ready on %s", rank, spec.size, runner.device)
    stats = RankStepStats(rank, spec.stats_every_s)

    def log_stats(line: str | None) -> None:
        if line:
            log.info("%s", line)
    while True:
        waiting_from = time.perf_counter()
        try:
            message = channel.receive()
        except RuntimeError as e:   # rank 0 is gone: its sockets closed
            log_stats(stats.close())
            log.warning("rank %d: rank 0 is gone (%s); exiting", rank, e)
            os._exit(1)
        if message.plan is None:
            break
        launching_from = time.perf_counter()
        runner.apply_before(message.ops)
        runner.run(message.plan, share_inputs=message.share_inputs)
        runner.apply_after(message.ops)
        log_stats(stats.add(waiting_from, launching_from, time.perf_counter()))
    log_stats(stats.close())
    runner.graphs = None         # the graphs hold the communicator the teardown frees
    teardown()
    os._exit(0)


def teardown(timeout_s: float = TEARDOWN_S) -> None:
    """Destroy the process groups, with the other ranks, giving up after timeout_s (a teardown that waits on a
    vanished rank, or on NCCL work the process still holds, would never return: the process exit frees it all)."""
    done = threading.Event()

    def destroy() -> None:
        dist.destroy_process_group()
        done.set()
    threading.Thread(target=destroy, name="specdec-rank-teardown", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("tensor-parallel teardown did not finish in %.0f s: left to the process exit", timeout_s)


class RankGroup:
    """Rank 0's side: the other ranks' processes and the host group that reaches them."""

    def __init__(self, spec: RankSpec):
        if spec.size < 2:
            raise ValueError("a rank group has at least 2 ranks")
        if torch.device(spec.device).type == "cuda" and torch.cuda.device_count() < spec.size:
            raise ValueError(f"--tensor-parallel-size {spec.size} needs {spec.size} GPUs; "
                             f"{torch.cuda.device_count()} visible")
        self.spec, self.closing, self.closed, self.lock = spec, False, False, threading.Lock()
        store_port = free_port()
        context = mp.get_context("spawn")
        self.processes = [context.Process(target=rank_main, args=(spec, r, store_port, os.getpid()),
                                          name=f"specdec-rank{r}", daemon=True) for r in range(1, spec.size)]
        for p in self.processes:
            p.start()
        self.lost_reported = False
        started = time.monotonic()
        try:
            self.tp, host = _join(spec, 0, store_port, self.check_alive)
        except BaseException:
            self.stop_processes(wait_s=0)
            raise
        self.channel = MessageChannel(host, spec.message_words)
        log.info("tensor parallel: %d ranks joined in %.1f s (pids %s)", spec.size, time.monotonic() - started,
                 ", ".join(str(p.pid) for p in self.processes))

    def build_runner(self) -> ModelRunner:
        return _build_runner(self.spec, self.tp)

    def send(self, message: StepMessage) -> None:
        """Tell every rank the next step (raises RankLost if one has exited, or the group is closed)."""
        with self.lock:   # the engine thread's steps and close(), which a stopping server calls from another
            if self.closed:
                raise RankLost("the tensor-parallel ranks were stopped")
            self.check_alive()
            try:
                self.channel.send(message)
            except RuntimeError as e:
                self.explain(e)
                raise RankLost(f"tensor-parallel step broadcast failed: {e}") from e

    def explain(self, error: RuntimeError) -> None:
        """Raise RankLost (from `error`) if a rank exited, as a broken collective usually means."""
        for _ in range(10):   # its exit code may lag the closed socket
            try:
                self.check_alive()
            except RankLost as lost:
                raise lost from error
            time.sleep(0.05)

    def check_alive(self) -> None:
        lost = self._lost()
        if lost:
            self.lost_reported = True
            raise RankLost(lost)

    def _lost(self) -> str | None:
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                return f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def watch(self) -> None:
        """Exit this process (code 3) when a rank is lost: REPORTED_GRACE_S after a step raised RankLost, or
        STUCK_AFTER_S after the loss when no step did. For a serving verifier (server.serve starts it), whose
        supervisor starts it again with every rank; a process that builds engines for other ends (tests,
        benchmarks) handles RankLost itself."""
        threading.Thread(target=self._watch, name="specdec-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.closing:
            lost = self._lost()
            if lost and not self.closing:
                deadline = time.monotonic() + STUCK_AFTER_S
                while not self.lost_reported and time.monotonic() < deadline:
                    time.sleep(0.1)
                if self.closing:
                    return
                if self.lost_reported:
                    time.sleep(REPORTED_GRACE_S)
                    log.critical("%s: the requests in flight failed; exiting for a restart with every rank", lost)
                else:
                    log.critical("%s and rank 0 is stuck waiting for it (a collective, loading, or idle): exiting",
                                 lost)
                logging.shutdown()
                os._exit(3)
            time.sleep(0.5)

    def close(self) -> None:
        """Stop the other ranks (after the last step)."""
        self.closing = True
        try:
            self.send(StepMessage(None, CacheOps(), False))
            self.closed = True
            teardown()           # with the others: NCCL's teardown waits for every rank's
        except RankLost:         # a rank is gone: no teardown would finish (this process is done with the group)
            pass
        self.closed = True
        self.stop_processes()

    def stop_processes(self, wait_s: float = 10.0) -> None:
        """Wait up to wait_s for each rank to exit, then kill it (after close(), or at once after a failed start)."""
        self.closing = True
        for p in self.processes:
            p.join(timeout=wait_s)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
