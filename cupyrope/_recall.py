"""A faster way back to the plan of a repeated call with torch tensors than fingerprints.

Plans are cached by fingerprint (_arrays.fingerprint: type, dtype, shape, strides, device, 16-byte alignment).
Reading a torch tensor's fingerprint from Python costs ~0.4 µs (five attribute reads and a tuple), and the key's
hash and lookup ~0.3 more: most of a decode call's own host time. torch has a C++ check of the same properties:
the guard torch.compile runs before it reuses a compiled graph (``torch._C._dynamo.guards.TensorGuards``: Python
type, dtype, device index, dispatch keys, requires_grad, shape and strides). So an op remembers its last few
calls with torch tensors, each with such a guard: a call with the same options whose tensors pass the guard and
whose pointers are all 16-byte aligned (only such calls are remembered, so the fingerprints would have been
equal) takes the plan after one C++ call (docs/perf-notes.md, "Host overhead").

The guard is a private torch API: it is used only after a self-test shows that it tells apart the changes a
fingerprint tells apart; otherwise (or without torch, or with CUPYROPE_RECALL=0 in the environment) recall()
finds nothing and every call takes fingerprints.
"""

import os
import sys

RECENT = 4  # calls remembered per op: a model alternates a few shapes per op (Qwen3's q_norm and k_norm)

_guard_class = None  # TensorGuards once its self-test passed; False: not usable here


class RecentCalls:
    """The last few (options, guard over the tensors, plan) of one op's calls with torch tensors."""

    def __init__(self):
        self._recent: tuple = ()  # newest first
        self._guards: dict = {}  # plan-cache key -> its entry: a guard is built once per signature

    def recall(self, options: tuple, tensors: tuple):
        """The plan of a remembered call with ``options`` whose guard ``tensors`` pass, or None. The caller
        still checks that the tensors' pointers are all 16-byte aligned."""
        for entry_options, guard, plan in self._recent:
            if entry_options == options and guard.check(*tensors):
                return plan
        return None

    def remember(self, options: tuple, tensors: tuple, pointers, key, plan) -> None:
        """Put a call planned (or found) through its fingerprints first among the recent ones, when its arrays
        are torch tensors (distinct: a guard rejects a tensor passed twice) and all its pointers are 16-byte
        aligned. ``key`` is its plan-cache key."""
        if not _guards_usable() or any(p & 15 for p in pointers):
            return
        entry = self._guards.get(key)
        if entry is None or entry[2] is not plan or not entry[1].check(*tensors):  # new, or requires_grad changed
            try:
                entry = (options, _guard_of(tensors), plan)
            except Exception:  # not torch tensors: fingerprints serve them
                return
            if len(self._guards) >= 4096:
                self._guards.clear()
            self._guards[key] = entry
        if self._recent[:1] != (entry,):
            self._recent = (entry, *[e for e in self._recent if e is not entry][: RECENT - 1])


def _guard_of(tensors):
    return _guard_class(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                        dynamic_dims_strides=[list(t.stride()) for t in tensors])


def _guards_usable() -> bool:
    global _guard_class
    if _guard_class is None:
        _guard_class = False
        if os.environ.get("CUPYROPE_RECALL", "1") == "0":
            return False
        try:
            torch = sys.modules["torch"]  # imported: remember() is called for torch tensors only
            from torch._C._dynamo.guards import TensorGuards

            if guard_tells_apart(TensorGuards, torch):
                _guard_class = TensorGuards
        except Exception:  # no such API in this torch: fingerprints only
            pass
    return bool(_guard_class)


def guard_tells_apart(guard_class, torch) -> bool:
    """Whether guard_class accepts tensors like those it was built for and rejects each change a fingerprint
    sees: strides, shape, rank, dtype, Python type (the device index cannot be varied on a CPU), and a tensor
    that is not the one of that position."""

    class Other(torch.Tensor):
        pass

    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64)
    guard = guard_class(a, b, dynamic_dims_sizes=[[2, 3], [4]], dynamic_dims_strides=[[3, 1], [1]])
    changed = [torch.empty_strided((2, 3), (1, 2)), torch.zeros(3, 2), torch.zeros(6), torch.zeros(2, 3, 1),
               torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3).as_subclass(Other), b]
    return (guard.check(torch.ones(2, 3), torch.ones(4, dtype=torch.int64))
            and not any(guard.check(t, b) for t in changed)
            and not guard.check(a, None))
