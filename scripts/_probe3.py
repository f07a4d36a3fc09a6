import sys, statistics, torch, cupyrope
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sweep_bwd import input_copies
from sweep_norm import apply
rows, hidden = int(sys.argv[1]), int(sys.argv[2])
_, copies = input_copies(rows, hidden, torch.bfloat16, torch.bfloat16)
big = torch.empty(64 << 20, dtype=torch.float32, device="cuda")  # 256 MB
before = {
    "self": None,
    "sleep": lambda: torch.cuda._sleep(40000),
    "read 256MB": lambda: big.sum(),
    "write 256MB": lambda: big.fill_(1.0),
}
for setting in sys.argv[3:]:
    apply(setting)
    cells = []
    for name, pre in before.items():
        times = []
        for i in range(24):
            x, w, dy = copies[i % len(copies)]
            if pre is None:
                x2, w2, dy2 = copies[(i + 1) % len(copies)]
                cupyrope.rms_norm_backward(dy2, x2, w2)
            else:
                pre()
            b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            b.record(); cupyrope.rms_norm_backward(dy, x, w); e.record()
            times.append((b, e))
        torch.cuda.synchronize()
        us = statistics.median(b.elapsed_time(e) * 1e3 for b, e in times[4:])
        cells.append(f"{name} {us:.1f}")
    print(f"{rows}x{hidden} [{setting or 'default'}]: " + "; ".join(cells), flush=True)
