"""Intra-op threads for a thread that runs model steps on the CPU (the verifier's engine thread, the drafter's
step handler).

PyTorch's CPU ops parallelise with OpenMP (libgomp), whose worker threads stay hot, spinning, only for parallel
regions started by the process's main thread: started from any other thread they sleep between regions, and every
op waits for them to wake. Measured on a 2-core CI machine: a 64x256 @ 256x256 matmul + softmax took 55 µs from the
main thread, 189 µs from another thread with 2 OpenMP threads, 81 µs from another thread with 1; the demo model's
MTP draft step took 3.3 ms in a main thread and 7.3 ms in the drafter service's handler thread. The OpenMP thread
count is per calling thread, so setting it here leaves the main thread's alone. CUDA steps do not use it.
"""
from __future__ import annotations

import torch


def serial_cpu_ops_in_this_thread(device: torch.device | str) -> None:
    """On the CPU, run this thread's ops without OpenMP workers (faster than waking them, see above)."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
