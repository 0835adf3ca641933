"""In one process, rounds alternated (``pack_cost.alternate``), the tier's pack with each change of
this session against the tree without it (the change undone by a patch of its function):

* ``start``: Note [a group is started in one function] against the general path for a group's
  first save (``group.start`` answering None);
* ``cycles``: Note [a freed entry is in no cycle] against parts and scopes that keep their cycles
  (``Cache.release`` and ``Scopes.forget_if_empty`` patched to restore them);
* ``small``: Note [a small save joins a full group] against ``Group.takes`` as it was (a full group
  takes nothing);
* ``passon``: Note [a group's region passes on] against a new region a group (``HostPool.split``
  answering None).

``python inproc_ab.py start|cycles|small|passon [rounds]``; outputs in ``ab_<name>.txt`` (start, cycles
and small were run before ``passon`` landed).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pack_cost  # noqa: E402

from ssdtrain.engine import cache, group, hooks, schedule  # noqa: E402
from ssdtrain.host import host_pool  # noqa: E402

_start, _release, _forget, _takes = hooks.start, cache.Cache.release, schedule.Scopes.forget_if_empty, group.Group.takes
_split = host_pool.HostPool.split


def _as_landed(off):
    hooks.start, cache.Cache.release, schedule.Scopes.forget_if_empty = _start, _release, _forget
    group.Group.takes, host_pool.HostPool.split = _takes, _split


def _new_region(off):
    _as_landed(off)
    host_pool.HostPool.split = lambda self, ext, nbytes: None


def _no_start(off):
    _as_landed(off)
    hooks.start = lambda *a: None


def _release_cyclic(self, e):
    state = _release(self, e)
    if e.grouped:
        for p in e.parts:
            p.entry = e
    return state


def _forget_cyclic(self, scope):
    order = scope.order
    _forget(self, scope)
    scope.order = order


def _cycles(off):
    _as_landed(off)
    cache.Cache.release, schedule.Scopes.forget_if_empty = _release_cyclic, _forget_cyclic


def _takes_before(self, n, stream, dev, most):
    return (len(self.parts) < most and self.nbytes + n <= group.GROUP_BYTES and self.stream is stream
            and self.device == dev)


def _small_own_entry(off):
    _as_landed(off)
    group.Group.takes = _takes_before


VARIANTS = {
    "start": {"group.start": _as_landed, "general path": _no_start},
    "cycles": {"no cycles": _as_landed, "cycles": _cycles},
    "small": {"small joins full": _as_landed, "own entry": _small_own_entry},
    "passon": {"passes on": _as_landed, "new region": _new_region},
}
pack_cost.alternate(VARIANTS[sys.argv[1]], int(sys.argv[2]) if len(sys.argv) > 2 else 7)
_as_landed(None)
