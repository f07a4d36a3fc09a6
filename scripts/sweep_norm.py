"""RMSNorm tuning sweep on a GPU (not the benchmark suite): planner settings x shapes, with peers.

Usage: python scripts/sweep_norm.py [--no-peers] [--fwd|--bwd|--add] [--big|--mid|--small|--lost|--latency|--decode|--scalar|--words|--long|--odd|--oddbwd|--reread|--split|--oddsplit] [--shifted] [--half|--f32] [--w32] [--plans] SETTING ...
--add times fused_add_rms_norm (in place; no peers) instead of the forward and backward; --fwd and --bwd one of them.
A SETTING is a comma-separated list of rmsnorm planner constants, e.g. "FWD_ELEMS_PER_THREAD=8,FWD_BLOCK_THREADS=256"
or entries of their tables, e.g. "FWD_MAX_SLOTS[True:2]=8", and NVRTC=... for kernel knobs of that
setting alone (e.g. "NVRTC=-DRMS_BWD_KEEP_WEIGHT=1")
("" = the defaults, the only setting when none is given).
Kernel knobs: CUPYROPE_EXTRA_NVRTC_OPTIONS="-DRMS_WEIGHT_BATCH=1 ..." (kernels_src/rms_norm.cu).
Each cupyrope setting is checked against torch in fp32 before it is timed. GPU time per call: the
benchmark suite's CUDA-graph replay over enough input copies to defeat the L2 (autograd peers: events
around an eager loop), as % of the copy bandwidth measured in the same run.
"""

import ast
import math
import os
import re
import sys

import torch

import cupyrope
from cupyrope import _arrays, _compile, bench, rmsnorm

dev = torch.device("cuda")
SHAPES = [(32768, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16), (8192, 16384, torch.bfloat16),
          (8192, 16384, torch.float32), (8192, 1027, torch.float32), (8192, 4096, torch.float32)]
SHAPES += [(8192, h, torch.bfloat16) for h in (61, 130, 256, 512, 1024, 1027, 2048)]
if "--big" in sys.argv:
    SHAPES = SHAPES[:6] + [(8192, h, torch.bfloat16) for h in (1024, 1027, 2048)]
if "--small" in sys.argv:  # a single wave or less: latency, not bandwidth
    SHAPES = [(512, h, torch.bfloat16) for h in (32, 1024, 4096, 16384)]
    SHAPES += [(2048, 4096, torch.bfloat16), (1024, 8192, torch.bfloat16), (8192, 1024, torch.bfloat16)]
if "--lost" in sys.argv:  # forward shapes of the [4, S, H] table where Liger was faster (session 5)
    SHAPES = [(512, h, torch.bfloat16) for h in (32, 128, 512, 1024, 1027, 2048, 4096, 8192, 16384)]
    SHAPES += [(2048, h, torch.bfloat16) for h in (512, 1027, 2048, 4096, 16384)]
    SHAPES += [(8192, h, torch.bfloat16) for h in (512, 1024, 2048, 4096, 16384)] + [(32768, 4096, torch.bfloat16)]
    SHAPES += [(512, 1024, torch.float32), (2048, 1027, torch.float32), (8192, 1027, torch.float32)]
    SHAPES += [(8192, h, torch.bfloat16) for h in (1027, 3072, 5120, 7168)]
if "--latency" in sys.argv:  # 512 rows (the table's S = 128) and a few single-wave grids
    SHAPES = [(512, h, torch.bfloat16) for h in (32, 61, 64, 128, 130, 256, 512, 1024, 1027, 2048, 4096, 16384)]
    SHAPES += [(2048, h, torch.bfloat16) for h in (61, 512, 1024, 2048)] + [(8192, 1024, torch.bfloat16)]
if "--scalar" in sys.argv:  # rows moved element by element (short odd rows)
    SHAPES = [(r, h, torch.bfloat16) for r in (512, 2048, 8192) for h in (61, 130)]
    SHAPES += [(512, 61, torch.float32), (8192, 130, torch.float32), (8192, 255, torch.bfloat16),
               (32768, 61, torch.bfloat16)]
if "--words" in sys.argv:  # bf16 rows of 2-4 chunks a thread (v14)
    SHAPES = [(r, h, torch.bfloat16) for r in (512, 2048, 8192) for h in (4096, 8192, 16384)]
    SHAPES += [(32768, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16), (8192, 3072, torch.bfloat16),
               (8192, 5120, torch.bfloat16), (8192, 7168, torch.bfloat16)]
    SHAPES += [(r, h, torch.bfloat16) for r, h in ((8192, 2053), (8192, 4099), (8192, 6151), (2048, 8195),
                                                     (2048, 12289), (512, 16389))]  # shifted rows
if "--decode" in sys.argv:  # 1-128 rows (decode batches; one partial wave) and the table's S = 128 losses
    SHAPES = [(r, h, torch.bfloat16) for r in (1, 16, 128) for h in (4096, 8192)]
    SHAPES += [(r, 4096, torch.float32) for r in (1, 128)]
    SHAPES += [(512, h, torch.bfloat16) for h in (256, 512, 1024, 2048)]
if "--long" in sys.argv:  # rows past the registers (the two-pass loop; the fused add's row cache)
    SHAPES = [(r, 16384, torch.float32) for r in (512, 2048, 8192)] + [(8192, 12288, torch.float32)]
    SHAPES += [(2048, 32768, torch.float32), (1024, 65536, torch.float32), (2048, 20001, torch.float32)]
    SHAPES += [(4096, 32768, torch.bfloat16), (8192, 24576, torch.bfloat16), (2048, 65536, torch.bfloat16),
               (4096, 20001, torch.bfloat16)]
if "--fwdlong" in sys.argv:  # the plain forward of rows of 8+ chunks a thread, and two-pass rows
    SHAPES = [(r, 16384, torch.float32) for r in (512, 2048, 8192)] + [(8192, 12288, torch.float32)]
    SHAPES += [(r, 32768, torch.bfloat16) for r in (512, 2048, 4096)] + [(2048, 20001, torch.bfloat16)]
if "--wide" in sys.argv:  # fp32 rows that 512 threads hold in 8 chunks or not at all (FWD_MAX_WIDTH)
    SHAPES = [(r, 16384, torch.float32) for r in (512, 2048, 8192)] + [(8192, 12288, torch.float32)]
    SHAPES += [(8192, 9000, torch.float32), (2048, 32768, torch.float32), (4096, 24576, torch.float32)]
    SHAPES += [(8192, 12291, torch.float32), (4096, 16389, torch.float32)]  # shifted rows
if "--wide16" in sys.argv:  # fp16/bf16 rows that 512 threads cannot hold in registers (FWD_MAX_WIDTH)
    SHAPES = [(8192, 16384, torch.bfloat16), (4096, 24576, torch.bfloat16), (4096, 32768, torch.float16)]
    SHAPES += [(r, 32768, torch.bfloat16) for r in (512, 2048, 4096)]
    SHAPES += [(2048, 20001, torch.bfloat16), (4096, 16389, torch.bfloat16)]  # shifted rows
if "--reread" in sys.argv:  # aligned backward rows past the registers: the staged REREAD variant (v22)
    SHAPES = [(8192, 18432, torch.bfloat16), (4096, 24576, torch.bfloat16), (4096, 32768, torch.bfloat16),
              (1024, 32768, torch.bfloat16), (4096, 32768, torch.float16), (4096, 20480, torch.float32),
              (2048, 28672, torch.float32), (8192, 16384, torch.bfloat16), (8192, 16384, torch.float32)]
if "--oddbwd" in sys.argv:  # odd backward rows past the staged kernel's one chunk a thread: reread, SHIFT (v23)
    SHAPES = [(8192, h, torch.bfloat16) for h in (4099, 6151, 8191)]
    SHAPES += [(4096, 12289, torch.bfloat16), (4096, 16389, torch.bfloat16), (2048, 20001, torch.bfloat16),
               (2048, 28001, torch.bfloat16), (4096, 16389, torch.float16), (8192, 4099, torch.float32),
               (8192, 6151, torch.float32), (4096, 8191, torch.float32), (4096, 16387, torch.float32),
               (8192, 18432, torch.bfloat16)]
if "--split" in sys.argv:  # aligned rows past one block (registers, shared memory): a cluster's blocks (v24)
    SHAPES = [(2048, 65536, torch.bfloat16), (4096, 40960, torch.bfloat16), (1024, 131072, torch.bfloat16),
              (512, 262144, torch.bfloat16), (4096, 65536, torch.float16), (2048, 32768, torch.float32),
              (4096, 40960, torch.float32), (1024, 65536, torch.float32), (8192, 32768, torch.bfloat16),
              (4096, 49152, torch.bfloat16)]
    if "--add" in sys.argv:  # the fused add splits rows from 16K elements (its registers hold less)
        SHAPES += [(4096, 24576, torch.bfloat16), (4096, 20480, torch.float32), (8192, 16400, torch.bfloat16)]
if "--oddsplit" in sys.argv:  # odd rows past one block (v25, v25b, v26: SHIFT on a cluster) and aligned neighbours
    SHAPES = [(2048, 30001, torch.bfloat16), (2048, 40001, torch.bfloat16), (2048, 40000, torch.bfloat16),
              (1024, 65539, torch.bfloat16), (1024, 65536, torch.bfloat16), (2048, 36001, torch.float16),
              (512, 131075, torch.bfloat16), (2048, 20001, torch.float32), (2048, 20000, torch.float32),
              (2048, 33001, torch.float32), (1024, 65537, torch.float32), (2048, 40961, torch.float16),
              (1024, 50001, torch.bfloat16), (2048, 40001, torch.float32), (1024, 100001, torch.bfloat16),
              (4096, 65539, torch.bfloat16)]
    if "--add" in sys.argv:  # only fp32 fused adds split (odd ones from 32761 elements)
        SHAPES = [(2048, 33001, torch.float32), (2048, 32768, torch.float32), (2048, 40001, torch.float32),
                  (1024, 65537, torch.float32), (2048, 24577, torch.float32)]
if "--two16" in sys.argv:  # aligned fp16/bf16 rows of 1025-2048 chunks: staged 2 x 1024 or reread
    SHAPES = [(8192, h, torch.bfloat16) for h in (8200, 10240, 12288, 14848, 16384)]
    SHAPES += [(4096, 12288, torch.bfloat16), (2048, 16384, torch.bfloat16), (8192, 12288, torch.float16),
               (4096, 8200, torch.bfloat16), (8192, 9216, torch.bfloat16), (8192, 4100, torch.float32),
               (8192, 8200, torch.float32), (8192, 5120, torch.float32)]
if "--fill" in sys.argv:  # aligned fp16/bf16 rows under STAGED_MIN_FILL_PCT of 512 x 2 slots (Gemma 2 27B: 4608)
    SHAPES = [(8192, 4608, torch.bfloat16), (4096, 4608, torch.bfloat16), (32768, 4608, torch.bfloat16),
              (8192, 4104, torch.bfloat16), (8192, 4864, torch.float16), (8192, 8200, torch.bfloat16)]
if "--oddpair" in sys.argv:  # odd rows next to aligned ones of the same width (both rms_norm_bwd_reread)
    SHAPES = [(4096, 16389, torch.bfloat16), (4096, 16392, torch.bfloat16), (2048, 28001, torch.bfloat16),
              (2048, 28008, torch.bfloat16), (8192, 8191, torch.bfloat16), (8192, 8200, torch.bfloat16),
              (4096, 16387, torch.float32), (4096, 16388, torch.float32)]
if "--odd" in sys.argv:  # rows read twice (v21): odd ones in shifted 16-byte chunks; aligned ones as before
    SHAPES = [(2048, 40001, torch.bfloat16), (2048, 36001, torch.float16), (2048, 33001, torch.float32),
              (8192, 8191, torch.bfloat16), (4096, 12289, torch.bfloat16), (2048, 20001, torch.bfloat16),
              (4096, 16387, torch.float32), (1024, 45001, torch.bfloat16)]
    SHAPES += [(2048, 65536, torch.bfloat16), (1024, 65536, torch.float32), (4096, 32768, torch.bfloat16)]
    if "--add" in sys.argv:
        SHAPES = [(4096, 20001, torch.bfloat16), (2048, 24577, torch.float16), (2048, 40001, torch.bfloat16),
                  (2048, 33001, torch.float32), (4096, 32768, torch.bfloat16), (2048, 65536, torch.bfloat16),
                  (2048, 20000, torch.float32)]
if "--shifted" in sys.argv:  # odd rows in 16-byte chunks from the row's shift (v27, v28: the weight's loads), aligned ones
    SHAPES = [(8192, 1027, torch.bfloat16), (32768, 1027, torch.bfloat16), (2048, 1027, torch.bfloat16),
              (512, 1027, torch.bfloat16), (8192, 2053, torch.bfloat16), (8192, 4099, torch.bfloat16),
              (8192, 8191, torch.bfloat16), (2048, 12289, torch.bfloat16), (4096, 16389, torch.bfloat16),
              (2048, 20001, torch.bfloat16), (8192, 1027, torch.float16), (8192, 1027, torch.float32),
              (8192, 4099, torch.float32), (4096, 16387, torch.float32), (8192, 1024, torch.bfloat16),
              (8192, 4096, torch.bfloat16)]
if "--mid" in sys.argv:
    SHAPES = [(32768, 4096, torch.bfloat16), (8192, 1027, torch.float32), (8192, 4096, torch.float32)]
    SHAPES += [(8192, h, torch.bfloat16) for h in (256, 512, 1024, 1027, 2048)]

if "--half" in sys.argv:  # the same shapes in fp16 instead of bf16
    SHAPES = [(r, h, torch.float16 if dt == torch.bfloat16 else dt) for r, h, dt in SHAPES]
if "--f32" in sys.argv:  # the same shapes in fp32
    SHAPES = [(r, h, torch.float32) for r, h, _ in SHAPES]

DEFAULTS = {n: getattr(rmsnorm, n) for n in dir(rmsnorm) if n.isupper()}
DEFAULT_OPTIONS = os.environ.get("CUPYROPE_EXTRA_NVRTC_OPTIONS", "")


def apply(setting):
    """rmsnorm's planner constants back to their defaults, then ``setting`` over them; plans cleared."""
    for name, value in DEFAULTS.items():
        setattr(rmsnorm, name, value)
    if setting == "old":  # the unstaged backward
        setting = "STAGED_MIN_ROW_BYTES=1000000000"
    options = DEFAULT_OPTIONS
    for item in filter(None, re.split(r",(?![^()]*\))", setting)):  # commas inside (...) belong to a tuple
        name, _, value = item.partition("=")
        if name == "NVRTC":  # NVRTC=-DKNOB=1 -DOTHER=2: kernel knobs for this setting only
            options = value
            continue
        name, _, key = name.partition("[")  # NAME[True:2]=8: one entry of a table (a copy is changed)
        if name not in DEFAULTS:
            raise SystemExit(f"{name}: not a planner constant of cupyrope.rmsnorm")
        if key:
            table = dict(getattr(rmsnorm, name))
            keys = tuple(ast.literal_eval(k) for k in key.rstrip("]").split(":"))
            table[keys if len(keys) > 1 else keys[0]] = int(value)
            setattr(rmsnorm, name, table)
        else:
            setattr(rmsnorm, name, ast.literal_eval(value))  # an int, or a tuple: SPLIT_SIZES=(4, 8)
    if options != os.environ.get("CUPYROPE_EXTRA_NVRTC_OPTIONS", ""):
        os.environ["CUPYROPE_EXTRA_NVRTC_OPTIONS"] = options
        _compile._functions.clear()  # compiled again with the options (CuPy's disk cache keys on them)
    rmsnorm._plans = _arrays.PlanCache()


def time_us(make_fn, copies, capture=True):
    return bench.gpu_time_us(torch, [make_fn(*c) for c in copies], capture=capture)


def peers():
    def f_fwd(x, w, dy):
        return lambda: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)

    def f_bwd(x, w, dy):
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = torch.nn.functional.rms_norm(xg, (x.shape[-1],), wg, 1e-6)
        return lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)

    out = {"F.rms_norm": (f_fwd, f_bwd)}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return out

    def l_bwd(x, w, dy):
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        yl = LigerRMSNormFunction.apply(xl, wl, 1e-6, 0.0, "llama", False)  # in_place=False: dy intact
        return lambda: torch.autograd.grad(yl, (xl, wl), dy, retain_graph=True)

    out["liger"] = (lambda x, w, dy: (lambda: LigerRMSNormFunction.apply(x, w, 1e-6)), l_bwd)
    return out


def check(x, w, dy, y, grads=None):
    """y (and grads = (dx, dweight), when given) against torch in fp32."""
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    ref = torch.nn.functional.rms_norm(xf, (x.shape[-1],), wf, 1e-6)
    pairs = [("y", y, ref)]
    if grads is not None:
        pairs += zip(("dx", "dw"), grads, torch.autograd.grad(ref, (xf, wf), dy.float()))
    for name, got, exp in pairs:
        err = (got.float() - exp).abs().max().item() / max(exp.abs().max().item(), 1e-30)
        assert err < 2e-2, f"{name} relative error {err:.2e}"


def check_add(x, w, r):
    """fused_add_rms_norm on copies against residual + x and F.rms_norm of it, in fp32."""
    xc, rc = x.clone(), r.clone()
    cupyrope.fused_add_rms_norm(xc, rc, w, 1e-6)
    total = (x.float() + r.float()).to(x.dtype)
    ref = torch.nn.functional.rms_norm(total.float(), (x.shape[-1],), w.float(), 1e-6)
    assert torch.equal(rc, total), "residual"
    err = (xc.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 2e-2, f"fused add: relative error {err:.2e}"


def main():
    settings = [a for a in sys.argv[1:] if not a.startswith("--")] or [""]
    ops = ("fwd",) if "--fwd" in sys.argv else ("add",) if "--add" in sys.argv else ("bwd",) if "--bwd" in sys.argv \
        else ("fwd", "bwd")
    with_peers = "--no-peers" not in sys.argv and "add" not in ops
    bw = bench.copy_bandwidth_gbps(torch)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s; % of it below; options "
          f"{os.environ.get('CUPYROPE_EXTRA_NVRTC_OPTIONS', '(default)')}")
    header = ["shape", "op"] + [f"cupyrope {s or 'default'}" for s in settings]
    header += ["F.rms_norm", "liger"] if with_peers else []
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for rows, hidden, dt in SHAPES:
        nbytes = 2 * rows * hidden * torch.finfo(dt).bits // 8
        copies = []
        for _ in range(bench.copies_for(nbytes)):
            x = torch.randn(rows, hidden, device=dev, dtype=dt)
            weight_dtype = torch.float32 if "--w32" in sys.argv else dt  # --w32: fp32 weights (mixed precision)
            copies.append((x, torch.randn(hidden, device=dev, dtype=weight_dtype), torch.randn_like(x)))
        results = {op: [] for op in ops}
        pristine = [t.clone() for t in copies[0]]  # the fused add's timing rewrites the copies in place
        for setting in settings:
            apply(setting)
            x, w, dy = copies[0]
            if "add" in ops:  # dy serves as the residual
                check_add(*pristine)
                results["add"].append(time_us(lambda x, w, r: (lambda: cupyrope.fused_add_rms_norm(x, r, w, 1e-6)), copies))
                continue
            grads = cupyrope.rms_norm_backward(dy, x, w) if "bwd" in ops else None  # --fwd: no backward
            check(x, w, dy, cupyrope.rms_norm(x, w, 1e-6), grads)
            if "fwd" in ops:
                results["fwd"].append(time_us(lambda x, w, dy: (lambda: cupyrope.rms_norm(x, w, 1e-6)), copies))
            if "bwd" in ops:
                results["bwd"].append(time_us(lambda x, w, dy: (lambda: cupyrope.rms_norm_backward(dy, x, w)), copies))
            if "--plans" in sys.argv:  # each setting's plans, for reading the table
                print(f"  {setting or 'default'}: " + "; ".join(map(repr, rmsnorm._plans._plans.values())), flush=True)
        for name, (fwd, bwd) in peers().items() if with_peers else ():
            runs = name != "liger" or hidden <= 65536  # Liger refuses longer rows (Triton's block size)
            if "fwd" in ops:
                results["fwd"].append(time_us(fwd, copies) if runs else math.nan)
            if "bwd" in ops:
                results["bwd"].append(time_us(bwd, copies, capture=False) if runs else math.nan)
        for op, times in results.items():
            moved = nbytes * {"fwd": 1, "bwd": 1.5, "add": 2}[op]
            cells = [f"{t:.{2 if t < 10 else 1}f} us {100 * moved / t / 1e3 / bw:.0f}%" for t in times]
            print(f"| {rows}x{hidden} {str(dt)[6:]} | {op} | " + " | ".join(cells) + " |", flush=True)
    apply("")


if __name__ == "__main__":
    main()
