"""In one process, rounds alternated (``pack_cost.alternate``): the tier's pack

* ``carve``: with a group's parts carved from one region (Note [a group's parts are carved from one
  region]) against an extent a part (``_carve`` False, the path before it): ``carve_ab.txt``;
* ``groups32``: groups of up to 32 storages against 8, both carved (not landed: larger groups raise
  the peak, docs/results.md): ``group_saves_ab.txt``;
* ``left_ab.txt``: a rule tried and not landed (groups of 32 closing before their forward's last
  eighth), measured by an earlier form of this script.

``python inproc_ab.py carve|groups32 [rounds]`` (the outputs here were printed by an earlier form of
this script, whose names were "carve True" for the first variant and "carve False" for the second).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pack_cost  # noqa: E402


VARIANTS = {
    "carve": {"carved": None, "an extent a part": lambda off: setattr(off, "_carve", False)},
    "groups32": {"32 storages": lambda off: setattr(off, "_group_saves", 32), "8 storages": None},
}
pack_cost.alternate(VARIANTS[sys.argv[1]], int(sys.argv[2]) if len(sys.argv) > 2 else 7)
