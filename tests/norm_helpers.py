"""Shared by the RMSNorm GPU tests: rows, strided inputs, and the plans a call made."""

import importlib

import numpy as np

import helpers
from helpers import n_gpus, poison, to_device


HIDDEN = [1, 61, 64, 130, 1027, 4096, 16384, 65536]
ROWS = [1, 7, 8192]
CHECKED_ROWS = 48  # large cases: every row is checked for NaN (unwritten), sampled rows against float64


def sample_rows(rows, rng):
    return np.arange(rows) if rows <= CHECKED_ROWS else np.sort(rng.choice(rows, CHECKED_ROWS, replace=False))


def strided_rows(host, dtype, kind, pad):
    """A (rows, hidden) view whose row stride is hidden + pad."""
    rows, hidden = host.shape
    wide = np.zeros((rows, hidden + pad))
    wide[:, :hidden] = host
    return to_device(wide, dtype, kind)[:, :hidden]


_OPS = {"fwd": "rms_norm", "add": "fused_add_rms_norm", "add_out": "add_rms_norm", "bwd": "rms_norm_backward"}


def fresh_plans(monkeypatch):
    """Empties the plan caches, so that the next call's plan can be looked at (planned)."""
    helpers.fresh_plans(monkeypatch)


def planned(op):
    """The first plan op's cache ("fwd", "add", "add_out" or "bwd") made since the caches were emptied (fresh_plans,
    helpers.use_choices)."""
    module_name, name = helpers.OP_PLANS[_OPS[op]]
    return next(iter(getattr(importlib.import_module(f"cupyrope.ops.{module_name}"), name).plans.values()))


def runs_clusters() -> bool:
    from cupyrope._runtime.device import runs_clusters

    return n_gpus() > 0 and runs_clusters(0)


def fill_next_allocation_with_nan(shape, dtype, kind):
    """The caching allocators (CuPy's pool, torch's) hand a freed block to the next request of its size:
    a NaN block freed here makes rows a kernel fails to write show up as NaN."""
    poison(to_device(np.zeros(shape), dtype, kind))
