"""Host cost of the tensor-parallel step message: rank 0 tells rank 1 one verify step (16 sequences, 3 drafts each)
over gloo, as `verifier_service/step_message.py` packs it (one fixed-size broadcast) and as `broadcast_object_list`
would (a pickle, then two broadcasts). Two processes on this machine's CPU.

    python -P bench/step_message_bench.py [--seqs 16] [--steps 1000]     (-P: bench/kernels.py is not kernels/)
"""
import argparse
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from specdec.models.batch_staging import StepPlan
from verifier_service.rank_group import RankSpec
from verifier_service.step_message import MessageChannel, StepMessage


def run(rank: int, port: int, seqs: int, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    plan = StepPlan.from_lists([[1] * 4] * seqs, [100] * seqs, [[i] * 10 for i in range(seqs)], list(range(seqs)),
                               num_drafts=[3] * seqs, logits="all")
    message = StepMessage(plan, [], True)
    channel = MessageChannel(None, RankSpec("", 2, runner={"max_seqs": seqs}).message_words)
    seconds = {}
    for name in ("broadcast_object_list", "step message"):
        for n in (20, steps):   # the first pass warms up
            start = time.perf_counter()
            for _ in range(n):
                if name == "broadcast_object_list":
                    dist.broadcast_object_list([message], src=0)
                elif rank == 0:
                    channel.send(message)
                else:
                    channel.receive()
            seconds[name] = (time.perf_counter() - start) / n
    dist.barrier()
    if rank == 0:
        print(", ".join(f"{name}: {s * 1e6:.0f} us per step" for name, s in seconds.items()))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args()
    from specdec_tools.local_stack import free_port
    mp.spawn(run, args=(free_port(), args.seqs, args.steps), nprocs=2)


if __name__ == "__main__":
    main()
