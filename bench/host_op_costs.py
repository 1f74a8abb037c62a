"""Host cost of the small per-step operations on the verifier's draft path, each timed alone in a warm loop
(microseconds per call): the row-index upload, the hidden-row gather and copy into the drafter's shared buffer,
event records, a queue hand-off between two threads. A comparison point for `specdec trace-report`, where the
same operations, once per step between other work, take several times longer.
Usage on a GPU machine: python3 bench/host_op_costs.py"""
import time, threading, queue, numpy as np, torch
from specdec.models.pinned_upload import PinnedUpload
from specdec.models.batch_staging import concat_ranges
dev = torch.device("cuda")
H = 2560
hidden = torch.randn(64, H, dtype=torch.bfloat16, device=dev)
buf = torch.empty(512, H, dtype=torch.bfloat16, device=dev)
ev = torch.cuda.Event(interprocess=True)
up = PinnedUpload(dev)
def t(name, f, n=2000):
    for _ in range(50): f()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(n): f()
    e = time.perf_counter()
    torch.cuda.synchronize()
    print(f"{name:<40} {(e-s)/n*1e6:8.1f} us")
starts, counts = np.array([0]), np.array([4])
t("concat_ranges", lambda: concat_ranges(starts, counts))
t("PinnedUpload(4 rows)", lambda: up(concat_ranges(starts, counts)))
idx = up(concat_ranges(starts, counts))
t("hidden[idx]", lambda: hidden[idx])
t("hidden[0:4] view", lambda: hidden[0:4])
rows = hidden[idx]
t("buf[:4].copy_(rows)", lambda: buf[:4].copy_(rows))
t("index_select out=", lambda: torch.index_select(hidden, 0, idx, out=buf[:4]))
t("event.record (interprocess)", lambda: ev.record())
ev2 = torch.cuda.Event()
t("event.record (plain)", lambda: ev2.record())
t("torch.cuda.current_stream()", lambda: torch.cuda.current_stream())
def full():
    r = hidden[up(concat_ranges(starts, counts))]
    buf[:4].copy_(r); ev.record()
t("full gather+copy+record", full)
# thread handoff latency through queue.Queue
q1, q2 = queue.Queue(), queue.Queue()
def echo():
    while True:
        x = q1.get()
        if x is None: return
        q2.put(x)
th = threading.Thread(target=echo, daemon=True); th.start()
def rt():
    q1.put(1); q2.get()
t("queue round trip between threads", rt, 2000)
q1.put(None)
# after a sync: first launch cost
def after_sync():
    torch.cuda.synchronize(); hidden[idx]
t("sync + index", after_sync, 500)
t("sync alone", torch.cuda.synchronize, 500)
