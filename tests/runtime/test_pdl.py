"""Programmatic dependent launch (PDL): the launch configuration the driver gets, the fallback to plain launches,
and on an sm_90+ GPU that calls launched early still see everything the kernel before them wrote."""

import ctypes
import os
import struct
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import cupyrope
from cupyrope import reference
from cupyrope._runtime import launch as _launch
from cupyrope._runtime.device import LAUNCH_CONFIG
from helpers import has_torch_cuda, n_gpus

CUDA_ERROR_NOT_SUPPORTED = 801


def test_set_pdl_takes_a_mode_and_returns_the_previous_one():
    before = cupyrope.pdl_mode()
    try:
        assert cupyrope.set_pdl("never") == before
        assert cupyrope.set_pdl(True) == "never" and cupyrope.pdl_mode() == "always"
        assert cupyrope.set_pdl(False) == "always" and cupyrope.pdl_mode() == "never"
        assert cupyrope.set_pdl("graphs") == "never" and cupyrope.pdl_mode() == "graphs"
        with pytest.raises(ValueError, match="mode: expected one of 'never', 'graphs', 'always'"):
            cupyrope.set_pdl("sometimes")
        assert cupyrope.pdl_mode() == "graphs"
    finally:
        cupyrope.set_pdl(before)


def test_a_bad_cupyrope_pdl_names_the_variable():
    run = subprocess.run([sys.executable, "-c", "import cupyrope"], capture_output=True, text=True,
                         env={**os.environ, "CUPYROPE_PDL": "sometimes"})
    assert run.returncode != 0 and "CUPYROPE_PDL: expected one of 'never', 'graphs', 'always'" in run.stderr
    ok = subprocess.run([sys.executable, "-c", "import cupyrope; print(cupyrope.pdl_mode())"], capture_output=True,
                        text=True, env={**os.environ, "CUPYROPE_PDL": "0"})
    assert ok.stdout.strip() == "never", ok.stderr


class CUlaunchConfig(ctypes.Structure):  # cuda.h
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


def test_launch_config_matches_cuda_h_layout():
    """LAUNCH_CONFIG packs a CUlaunchConfig, as the launcher and the cluster occupancy query pass it."""
    fields = {name: getattr(CUlaunchConfig, name).offset for name, _ in CUlaunchConfig._fields_}
    assert LAUNCH_CONFIG.size == ctypes.sizeof(CUlaunchConfig) == 56
    packed = LAUNCH_CONFIG.pack(1, 2, 3, 4, 5, 6, 7, 0x1122334455667788, 0x99AA, 1)
    assert struct.unpack_from("<Q", packed, fields["stream"])[0] == 0x1122334455667788
    assert struct.unpack_from("<Q", packed, fields["attrs"])[0] == 0x99AA
    assert struct.unpack_from("<I", packed, fields["num_attrs"])[0] == 1
    assert struct.unpack_from("<I", packed, fields["shared_mem"])[0] == 7
    # CUlaunchAttribute: the id, padding to 8 bytes, then the 64-byte value union (an int here).
    attribute = _launch._PDL_ATTRIBUTE.raw
    assert len(attribute) == 72
    assert struct.unpack_from("<Ii", attribute, 0)[0] == _launch.PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert struct.unpack_from("<i", attribute, 8)[0] == 1


def _launch_with(monkeypatch, launch_ex_status, mode="always", capturing=False):
    """A Launch on a stand-in driver whose cuLaunchKernelEx returns launch_ex_status, with set_pdl(mode) and a
    stream that is capturing a graph or not; the calls each launch function got."""
    calls = {"ex": [], "plain": []}

    def launch_ex(config, function, params, extra):
        calls["ex"].append(ctypes.string_at(config, LAUNCH_CONFIG.size))
        return launch_ex_status

    monkeypatch.setattr(_launch, "_bind", lambda: None)
    monkeypatch.setattr(_launch, "_runtime", SimpleNamespace(getDevice=lambda: 0, setDevice=lambda device: None,
                                                             streamIsCapturing=lambda stream: capturing))
    monkeypatch.setattr(_launch, "_driver", SimpleNamespace(launchKernel=lambda *args: calls["plain"].append(args),
                                                            CUDADriverError=RuntimeError))
    monkeypatch.setattr(_launch, "_torch_stream", lambda device: 0x5000)
    monkeypatch.setattr(_launch, "_programmatic", lambda device: True)
    monkeypatch.setattr(_launch, "_launch_ex", launch_ex)
    monkeypatch.setattr(_launch, "_pdl", _launch.PDL_MODES.index(mode))
    launch = _launch.Launch(SimpleNamespace(ptr=0x1234), 96, (32, 4), 2, b"\x00" * 8, 0, "torch", shared_mem=640)
    return launch, calls


def test_programmatic_launch_passes_the_plan_and_stream(monkeypatch):
    launch, calls = _launch_with(monkeypatch, 0)
    launch(0xA, 0xB)
    assert not calls["plain"] and len(calls["ex"]) == 1
    grid, _, _, bx, by, _, shared, stream, attrs, count = LAUNCH_CONFIG.unpack(calls["ex"][0])
    assert (grid, bx, by, shared, stream, count) == (96, 32, 4, 640, 0x5000, 1)
    assert attrs == ctypes.addressof(_launch._PDL_ATTRIBUTE)
    monkeypatch.setattr(_launch, "_pdl", _launch.NEVER)  # set_pdl("never"): plain launches
    launch(0xA, 0xB)
    assert len(calls["plain"]) == 1 and len(calls["ex"]) == 1


@pytest.mark.parametrize("capturing", [False, True])
def test_by_default_only_launches_into_a_graph_right_after_a_cupyrope_launch_take_pdl(monkeypatch, capturing):
    """"graphs": each launch adds a node to the capturing stream; one whose stream's last node is a cupyrope launch
    is programmatic, one after the capture's start or after another node (a torch kernel) is plain, and so is every
    eager launch."""
    launch, calls = _launch_with(monkeypatch, 0, mode="graphs", capturing=capturing)
    foreign = {"nodes": 0}  # nodes other libraries added
    monkeypatch.setattr(_launch, "_own_tails", {})
    monkeypatch.setattr(_launch, "capture_tail",
                        lambda stream: (7, len(calls["ex"]) + len(calls["plain"]) + 1000 * foreign["nodes"]))
    launch(0xA, 0xB)
    assert (len(calls["ex"]), len(calls["plain"])) == (0, 1)  # the capture's first node, or eager
    launch(0xA, 0xB)
    assert (len(calls["ex"]), len(calls["plain"])) == ((1, 1) if capturing else (0, 2))
    foreign["nodes"] += 1
    launch(0xA, 0xB)
    assert (len(calls["ex"]), len(calls["plain"])) == ((1, 2) if capturing else (0, 3))


def test_a_driver_refusing_pdl_gets_plain_launches(monkeypatch):
    launch, calls = _launch_with(monkeypatch, CUDA_ERROR_NOT_SUPPORTED)
    launch(0xA, 0xB)
    launch(0xA, 0xB)
    assert len(calls["ex"]) == 1 and len(calls["plain"]) == 2  # refused once, then plain for this plan
    assert launch.pdl is False


# ------------------------------------------------------------------------------------------------ on a GPU


requires_pdl_gpu = pytest.mark.skipif(not (has_torch_cuda() and n_gpus() > 0 and _launch._programmatic(0)),
                                      reason="needs torch with CUDA and an sm_90+ GPU (programmatic dependent launch)")


@pytest.fixture
def pdl_setting():
    before = cupyrope.pdl_mode()
    yield cupyrope.set_pdl
    cupyrope.set_pdl(before)


def _chain(x, w, positions, heads):
    """Calls of every kind, each reading what the one before it wrote (a torch kernel between some)."""
    y = x
    for _ in range(3):
        y = cupyrope.rms_norm(y, w, 1e-6)
        dx, dw = cupyrope.rms_norm_backward(y, x, w)
        residual = dx * 0.5
        cupyrope.fused_add_rms_norm(y, residual, w, 1e-6)
        if heads:
            y = cupyrope.rope(y.view(y.shape[0], heads, -1), positions).view(y.shape)
    return y, residual, dw


def _replayed(device, calls):
    """What ``calls()`` returns when captured into a CUDA graph on a side stream of ``device`` (after a warm-up run
    outside the capture: plans, allocator) and replayed once; the current device is left as it was."""
    import torch

    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            calls()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                captured = calls()
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
    return captured


@pytest.mark.gpu
@requires_pdl_gpu
@pytest.mark.parametrize("rows, hidden, heads", [(7, 1027, 0), (16, 4096, 32), (512, 256, 2), (8192, 4096, 32)])
def test_dependent_calls_give_the_same_bits_with_and_without_pdl(pdl_setting, rows, hidden, heads):
    """Backward of 16 rows is one cluster launch, of 8192 two launches (the second reads the first's partial
    sums). Plain launches against PDL eager ("always") and in a CUDA graph (the default, "graphs")."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    positions = torch.randint(0, 4096, (rows,), device="cuda", generator=g)
    pdl_setting("never")
    plain = _chain(x, w, positions, heads)
    pdl_setting("always")
    eager = _chain(x, w, positions, heads)
    pdl_setting("graphs")
    captured = _replayed(x.device, lambda: _chain(x, w, positions, heads))
    assert all(torch.isfinite(t.float()).all() for t in plain)
    for a, b, c in zip(plain, eager, captured):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.gpu
@requires_pdl_gpu
def test_a_call_launched_early_waits_for_the_kernel_before_it(pdl_setting):
    """A long forward writes its output (poisoned first) and lets the next kernel launch as its last blocks start;
    the next call reads that output's last rows at once. Without the kernels' wait it reads NaN (checked by
    building the kernels without griddepcontrol.wait)."""
    import torch

    pdl_setting("always")
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)
    y = torch.empty_like(x)
    for _ in range(3):
        y.fill_(float("nan"))
        cupyrope.rms_norm(x, w, 1e-6, out=y)
        tail = cupyrope.rms_norm(y[-8:], w, 1e-6)
        torch.cuda.synchronize()
        y_tail = y[-8:].float().cpu().numpy().astype(np.float64)
        expected = reference.rms_norm(y_tail, w.float().cpu().numpy().astype(np.float64), 1e-6)
        got = tail.float().cpu().numpy()
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=2 ** -7, atol=2 ** -7 * np.abs(expected).max())


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(n_gpus() < 2, reason="needs 2 GPUs (run it on a 2-GPU machine)")
@requires_pdl_gpu
def test_pdl_on_the_second_gpu_while_the_first_is_current(pdl_setting):
    """The launcher switches to the inputs' device for the launch: PDL launches there (eager and captured into a
    graph on cuda:1's stream) give plain launches' bits, and the current device stays cuda:0."""
    import torch

    assert torch.cuda.current_device() == 0
    dev = torch.device("cuda:1")
    g = torch.Generator(device=dev).manual_seed(11)
    x = torch.randn(512, 4096, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16, generator=g)
    positions = torch.randint(0, 4096, (512,), device=dev, generator=g)
    pdl_setting("never")
    plain = _chain(x, w, positions, 32)
    pdl_setting("always")
    eager = _chain(x, w, positions, 32)
    pdl_setting("graphs")
    captured = _replayed(dev, lambda: _chain(x, w, positions, 32))
    assert torch.cuda.current_device() == 0
    assert all(t.device == dev and torch.isfinite(t.float()).all() for t in plain)
    for a, b, c in zip(plain, eager, captured):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.gpu
@requires_pdl_gpu
def test_in_a_graph_only_a_launch_right_after_a_cupyrope_launch_is_programmatic(pdl_setting, monkeypatch):
    """Captured: norm, norm (after a cupyrope launch: PDL), a torch kernel, norm (after it: plain). The replay gives
    the plain launches' bits."""
    import torch

    pdl_setting("graphs")
    programmatic = []
    launch_ex = _launch._launch_ex

    def counting(config, function, params, extra):
        programmatic.append(function)
        return launch_ex(config, function, params, extra)

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)

    def calls():
        y = cupyrope.rms_norm(cupyrope.rms_norm(x, w, 1e-6), w, 1e-6)
        return cupyrope.rms_norm(y * 0.5, w, 1e-6)

    plain = calls()
    monkeypatch.setattr(_launch, "_launch_ex", counting)
    captured = _replayed(x.device, calls)
    assert len(programmatic) == 1
    assert torch.isfinite(plain.float()).all() and torch.equal(plain, captured)
