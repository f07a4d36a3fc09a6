"""The one preamble of every call: find the call's plan and its arrays' pointers.

A plan is a pure function of the call's signature (each array's type, dtype, shape, strides, device and 16-byte
alignment: its fingerprint, and the options), so plans are cached by signature, and a repeated call skips the
checks and the planning (tens of microseconds of Python) and only substitutes its pointers.

Reading a torch tensor's fingerprint from Python costs ~0.4 µs (five attribute reads and a tuple) and the key's
hash and lookup ~0.3 more: most of a decode call's own host time. torch has a C++ check of the same properties:
the guard torch.compile runs before it reuses a compiled graph (``torch._C._dynamo.guards.TensorGuards``: Python
type, dtype, device index, dispatch keys, requires_grad, shape and strides). So an op also remembers its last few
calls with torch tensors, each with such a guard ("recall"): a call with the same options whose tensors pass the
guard and whose pointers are all 16-byte aligned (only such calls are remembered, so the fingerprints would have
been equal) takes the plan after one C++ call. The guard is a private torch API: it is used only after a
self-test shows that it tells apart the changes a fingerprint tells apart; otherwise (or without torch, or with
CUPYROPE_RECALL=0 in the environment) every call takes fingerprints.
"""

import operator
import os
import sys
import weakref
from functools import reduce

from .arrays import TORCH_TYPES, describe_optional, fingerprint, fingerprint_optional

RECENT = 4  # calls remembered per op: a model alternates a few shapes per op (Qwen3's q_norm and k_norm)
PLAN_LIMIT = 4096  # plans kept per op before the cache starts again


class EmptyPlan:
    """Plan of a call with nothing to compute (zero-size input); the planner attaches the allocators of the
    results it still returns."""

    grid = 0


_ALL_OPS = weakref.WeakSet()  # every live OpPlans, for forget_plans (tests' emptied copies come and go)


def forget_plans() -> None:
    """Empties every op's plans and recent calls: the next calls plan again (with the launch profile of then)."""
    for op in _ALL_OPS:
        op.plans.clear()
        op.recent = RecentCalls()


class OpPlans:
    """The plans of one op's calls. ``names``: the op's array arguments, in the order calls pass them, those in
    ``optional`` may be None; ``make_plan(*arrays described, *options)`` checks a call's arguments and plans it
    (raising for bad ones)."""

    def __init__(self, names: tuple[str, ...], make_plan, optional=()):
        self.names = names
        self.make_plan = make_plan
        self.optional = optional
        self._fingerprints = [fingerprint_optional if name in optional else fingerprint for name in names]
        self._aligned_pointers = _ALIGNED_POINTERS.get(len(names), _aligned_pointers)
        self.plans: dict = {}
        self.recent = RecentCalls()
        _ALL_OPS.add(self)

    def emptied(self) -> "OpPlans":
        """A new OpPlans for the same op, with no plans and no recent calls."""
        return OpPlans(self.names, self.make_plan, self.optional)

    def find(self, arrays: tuple, options: tuple):
        """(plan, pointers) of a call: ``arrays`` are its array arguments (None where absent), ``options``
        everything else its plan depends on (hashable, and saying which arrays are None)."""
        recalled = type(arrays[0]) in TORCH_TYPES
        if recalled:
            for entry_options, present, guard, plan in self.recent._recent:  # RecentCalls.recall, inlined
                if entry_options == options and guard.check(*present(arrays)):
                    pointers = self._aligned_pointers(arrays)
                    if pointers is not None:
                        return plan, pointers
                    break
        keys, pointers = [], []
        for array, name, fingerprint_of in zip(arrays, self.names, self._fingerprints):
            key, pointer = fingerprint_of(array, name)
            keys.append(key)
            pointers.append(pointer)
        key = (*keys, *options)
        try:
            plan = self.plans.get(key)
        except TypeError:  # an unhashable option: planned (and refused by its check) without the cache
            return self.make_plan(*map(describe_optional, arrays, self.names), *options), pointers
        if plan is None:
            plan = self.make_plan(*map(describe_optional, arrays, self.names), *options)
            if len(self.plans) >= PLAN_LIMIT:
                self.plans.clear()
            self.plans[key] = plan
        if recalled:
            self.recent.remember(options, arrays, pointers, key, plan)
        return plan, pointers


class RecentCalls:
    """The last few (options, present arrays, guard over them, plan) of one op's calls with torch tensors."""

    def __init__(self):
        self._recent: tuple = ()  # newest first
        self._entries: dict = {}  # plan-cache key -> its entry: a guard is built once per signature

    def recall(self, options: tuple, arrays: tuple):
        """The plan of a remembered call with ``options`` whose guard the present ``arrays`` pass, or None.
        The caller still checks that the arrays' pointers are all 16-byte aligned."""
        for entry_options, present, guard, plan in self._recent:
            if entry_options == options and guard.check(*present(arrays)):
                return plan
        return None

    def remember(self, options: tuple, arrays: tuple, pointers, key, plan) -> None:
        """Put a call planned (or found) through its fingerprints first among the recent ones, when its arrays
        are torch tensors (distinct: a guard rejects a tensor passed twice) and all its pointers are 16-byte
        aligned. ``key`` is its plan-cache key."""
        if not _guards_usable() or reduce(operator.or_, pointers) & 15:
            return
        entry = self._entries.get(key)
        present = _picker(arrays)
        if entry is None or entry[3] is not plan or not entry[2].check(*present(arrays)):  # requires_grad changed
            try:
                entry = (options, present, _guard_of(present(arrays)), plan)
            except Exception:  # not all torch tensors: fingerprints serve them
                return
            if len(self._entries) >= PLAN_LIMIT:
                self._entries.clear()
            self._entries[key] = entry
        if self._recent[:1] != (entry,):
            self._recent = (entry, *[e for e in self._recent if e is not entry][: RECENT - 1])


def _aligned_pointers(arrays):
    """The torch tensors' pointers (0 where None), or None where one is not 16-byte aligned."""
    pointers = [0 if a is None else a.data_ptr() for a in arrays]
    return None if reduce(operator.or_, pointers) & 15 else pointers


# The same for the ops' arities, written out: a recalled call's pointers are most of its remaining host time. The
# first array is never None (it is the op's main input).
def _aligned_pointers_3(a):
    p0, p1, p2 = a[0].data_ptr(), 0 if a[1] is None else a[1].data_ptr(), 0 if a[2] is None else a[2].data_ptr()
    return None if (p0 | p1 | p2) & 15 else (p0, p1, p2)


def _aligned_pointers_4(a):
    p0, p1 = a[0].data_ptr(), 0 if a[1] is None else a[1].data_ptr()
    p2, p3 = 0 if a[2] is None else a[2].data_ptr(), 0 if a[3] is None else a[3].data_ptr()
    return None if (p0 | p1 | p2 | p3) & 15 else (p0, p1, p2, p3)


def _aligned_pointers_6(a):
    p0, p1, p2 = a[0].data_ptr(), 0 if a[1] is None else a[1].data_ptr(), 0 if a[2] is None else a[2].data_ptr()
    p3, p4, p5 = (0 if a[3] is None else a[3].data_ptr(), 0 if a[4] is None else a[4].data_ptr(),
                  0 if a[5] is None else a[5].data_ptr())
    return None if (p0 | p1 | p2 | p3 | p4 | p5) & 15 else (p0, p1, p2, p3, p4, p5)


def _aligned_pointers_8(a):
    p0, p1, p2 = a[0].data_ptr(), 0 if a[1] is None else a[1].data_ptr(), 0 if a[2] is None else a[2].data_ptr()
    p3, p4, p5 = (0 if a[3] is None else a[3].data_ptr(), 0 if a[4] is None else a[4].data_ptr(),
                  0 if a[5] is None else a[5].data_ptr())
    p6, p7 = 0 if a[6] is None else a[6].data_ptr(), 0 if a[7] is None else a[7].data_ptr()
    return None if (p0 | p1 | p2 | p3 | p4 | p5 | p6 | p7) & 15 else (p0, p1, p2, p3, p4, p5, p6, p7)


def _aligned_pointers_10(a):
    p0, p1, p2 = a[0].data_ptr(), 0 if a[1] is None else a[1].data_ptr(), 0 if a[2] is None else a[2].data_ptr()
    p3, p4, p5 = (0 if a[3] is None else a[3].data_ptr(), 0 if a[4] is None else a[4].data_ptr(),
                  0 if a[5] is None else a[5].data_ptr())
    p6, p7 = 0 if a[6] is None else a[6].data_ptr(), 0 if a[7] is None else a[7].data_ptr()
    p8, p9 = 0 if a[8] is None else a[8].data_ptr(), 0 if a[9] is None else a[9].data_ptr()
    return None if (p0 | p1 | p2 | p3 | p4 | p5 | p6 | p7 | p8 | p9) & 15 else (p0, p1, p2, p3, p4, p5, p6, p7, p8, p9)


_ALIGNED_POINTERS = {3: _aligned_pointers_3, 4: _aligned_pointers_4, 6: _aligned_pointers_6, 8: _aligned_pointers_8,
                     10: _aligned_pointers_10}


def _picker(arrays: tuple):
    """A function (arrays) -> the tuple of those that are present in this call (not None)."""
    indices = [i for i, a in enumerate(arrays) if a is not None]
    if len(indices) == 1:
        index = indices[0]
        return lambda arrays: (arrays[index],)
    return operator.itemgetter(*indices)


def _guard_of(tensors):
    return _guard_class(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                        dynamic_dims_strides=[list(t.stride()) for t in tensors])


_guard_class = None  # TensorGuards once its self-test passed; False: not usable here


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
