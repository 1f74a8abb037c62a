"""Threads that run model steps (the verifier's engine thread, the drafter's step handler): their intra-op
threads on the CPU, and their current GPU (step_thread_on).

PyTorch's CPU ops parallelise with OpenMP (libgomp). Measured on a 2-core CI machine with 2 OpenMP threads, the
same ops ran much slower from a thread other than the main one: a 64x256 @ 256x256 matmul + softmax took 55 µs
from the main thread, 189 µs from another thread, 81 µs from another thread with 1 OpenMP thread; the demo model's
MTP draft step took 3.3 ms in a main thread and 7.3 ms in the drafter service's handler thread (libgomp's workers
wait hot for the main thread's parallel regions, not for this thread's: our reading, not traced in its source).

Scope: a thread that already ran a parallel region (the main thread, which loaded the model and warmed up) keeps
its own count; but libgomp takes this call, from a thread that has not, as the process-wide default, so threads
that start their first parallel region afterwards (later gRPC handler threads) run with one thread too. CUDA
steps do not use OpenMP.
"""
from __future__ import annotations

import torch


def serial_cpu_ops_in_this_thread(device: torch.device | str) -> None:
    """On the CPU, run this thread's ops without OpenMP workers (faster than waking them, see above)."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)


def use_gpu_in_this_thread(device: torch.device | str) -> None:
    """A GPU given by index (cuda:1) becomes this thread's current one. CUDA's current device is per thread, and a
    new thread (a gRPC handler) starts on GPU 0: a drafter on cuda:1 would capture its graphs, and take its current
    streams, on the wrong GPU. Nothing for the CPU or a bare "cuda"."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is not None:
        torch.cuda.set_device(d)


def step_thread_on(device: torch.device | str) -> None:
    """Make this thread ready to run model steps on `device`: its GPU, or on the CPU serial ops (above). Not for a
    main thread on the CPU, which keeps its OpenMP threads."""
    use_gpu_in_this_thread(device)
    serial_cpu_ops_in_this_thread(device)
