import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import gpu_status  # noqa: E402


# Fresh random inputs every session; CUPYROPE_SEED=<n> reproduces a failing one.
SESSION_SEED = int(os.environ.get("CUPYROPE_SEED", int.from_bytes(os.urandom(4), "little")))


def pytest_report_header(config):
    n, reason = gpu_status()
    gpus = f"{n} device(s)" if n else "skipped -- " + reason
    return [f"cupyrope GPU tests: {gpus}", f"cupyrope random seed: CUPYROPE_SEED={SESSION_SEED}"]


@pytest.fixture
def rng(request):
    import zlib

    import numpy as np

    return np.random.default_rng([SESSION_SEED, zlib.crc32(request.node.nodeid.encode())])
