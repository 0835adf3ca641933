"""``ssdtrain`` command line: ``bench``, ``plan`` and ``probe``.

Each subcommand lives in its own module with its own ``main(argv)``; this file only dispatches,
so that ``ssdtrain plan`` never imports what ``ssdtrain bench`` needs.
"""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "bench": ("ssdtrain.bench", "train a GPT-style decoder with and without offloading, side by side"),
    "plan": ("ssdtrain.planner.plan", "size micro-batches, pipeline stages and drive bandwidth for a real run"),
    "probe": ("ssdtrain.tools.probe", "measure the raw O_DIRECT bandwidth of storage paths"),
    "selftest": ("ssdtrain.tools.selftest", "check that offloading works here: exact gradients, GDS, compute overlap"),
}


def _usage() -> str:
    lines = ["usage: ssdtrain {bench,plan,probe} [options]  (ssdtrain COMMAND --help for its options)", ""]
    lines += [f"  {name:<6} {text}" for name, (_, text) in _COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"ssdtrain: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
