"""Host cost of one kernel launch through each Python launch path, against cuLaunchKernel called from C.

Issue #3 asks whether CuPy's launch path is what keeps small calls above the floor, and to take a
leaner one (e.g. the CUDA driver API through cuda-python) if it is faster. Each row launches the same
empty kernel (one pointer parameter, 1 block of 32 threads) on the current stream; host time per call,
no synchronization in the timed loop, median of 15 loops of 400 calls. Compare rows of one run only.
The C floor needs a C compiler (`cc`) on the machine; without one that row is left out.
Usage: python scripts/launch_paths.py
"""

import ctypes
import os
import statistics
import subprocess
import tempfile

import cupy

from cupyrope import _launch, bench

C_LOOP = r"""
#include <time.h>
typedef int (*launch_fn)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
double launch_loop(launch_fn launch, void* f, void* stream, void** params, int n) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n; ++i) launch(f, 1, 1, 1, 32, 1, 1, 0, stream, params, 0);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n;
}
"""


def c_floor_us(libcuda, function: int, stream: int, params: int):
    """cuLaunchKernel in a C loop (the floor no Python path can beat), or None without a compiler."""
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "loop.c"), os.path.join(tmp, "loop.so")
        with open(src, "w") as f:
            f.write(C_LOOP)
        try:
            subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as error:
            print(f"(no C floor: {error})")
            return None
        loop = ctypes.CDLL(lib).launch_loop
        loop.restype = ctypes.c_double
        loop.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int]
        address = ctypes.cast(libcuda.cuLaunchKernel, ctypes.c_void_p).value
        values = []
        for _ in range(15):
            cupy.cuda.Device().synchronize()
            values.append(loop(address, function, stream, params, 400) / 1e3)
        cupy.cuda.Device().synchronize()
        return statistics.median(values)


def main() -> None:
    x = cupy.zeros(32, dtype=cupy.float32)
    raw = cupy.RawKernel(r'extern "C" __global__ void noop(float* x) {}', "noop")
    raw((1,), (32,), (x,))
    function = raw.kernel.ptr
    stream = cupy.cuda.get_current_stream().ptr
    # The kernel's parameter: one pointer, as cuLaunchKernel's void** kernelParams.
    value = ctypes.c_void_p(x.data.ptr)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(value))
    params_address = ctypes.addressof(params)
    driver = cupy.cuda.driver
    launcher = _launch.Launch(type("K", (), {"ptr": function})(), 1, (32, 1), 1, b"", x.device.id, "cupy")

    rows = {
        "CuPy RawKernel call": lambda: raw((1,), (32,), (x,)),
        "cupyrope Launch (stream, device check, pack, CuPy's driver.launchKernel)": lambda: launcher(x.data.ptr),
        "CuPy driver.launchKernel alone (Cython)": lambda: driver.launchKernel(
            function, 1, 1, 1, 32, 1, 1, 0, stream, params_address, 0),
    }
    libcuda = ctypes.CDLL("libcuda.so.1")
    c_launch = libcuda.cuLaunchKernel
    c_launch.restype = ctypes.c_int
    c_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    rows["ctypes cuLaunchKernel (argtypes set)"] = lambda: c_launch(function, 1, 1, 1, 32, 1, 1, 0, stream,
                                                                    params_address, None)
    try:
        from cuda.bindings import driver as cuda_driver

        cu_function, cu_stream = cuda_driver.CUfunction(function), cuda_driver.CUstream(stream)
        rows["cuda-python cuLaunchKernel (cuda.bindings.driver)"] = lambda: cuda_driver.cuLaunchKernel(
            cu_function, 1, 1, 1, 32, 1, 1, 0, cu_stream, params_address, 0)
    except Exception as error:  # optional: report why the row is missing
        print(f"(no cuda-python row: {type(error).__name__}: {error})")
    steps = {
        "  step: CuPy runtime.getDevice": cupy.cuda.runtime.getDevice,
        "  step: CuPy current stream .ptr": lambda: cupy.cuda.get_current_stream(0).ptr,
    }
    for fn in rows.values():
        fn()
    cupy.cuda.Device().synchronize()
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, CuPy {cupy.__version__}")
    print("| launch path | host µs per call |\n|---|---|")
    floor = c_floor_us(libcuda, function, stream, params_address)
    if floor is not None:
        print(f"| cuLaunchKernel from a C loop (floor) | {floor:.2f} |")
    for name, fn in {**rows, **steps}.items():
        print(f"| {name} | {bench.host_only_us(fn, cupy.cuda.Device().synchronize):.2f} |")


if __name__ == "__main__":
    main()
