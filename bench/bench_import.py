"""What ``import sdkcore`` costs in a fresh process, and how much of it is sdkcore's own.

Run:  uv run python bench/bench_import.py [--runs N] [--tree DIR]

attrs is a fixed dependency (the value objects are attrs frozen/slots classes), so
``import sdkcore`` can never cost less than ``import attrs``. Each run starts fresh
interpreters, interleaved (the order alternates from run to run), one per variant:

* ``import attrs``: the floor;
* ``import sdkcore``: the whole cost, attrs included;
* ``import attrs`` first, then ``import sdkcore`` timed alone in the same process: a
  direct reading of sdkcore's own share;
* ``import attrs, asyncio`` first, then ``import sdkcore`` timed alone: its share in an
  asyncio application (asyncio imports ``logging``, which sdkcore uses when present).

Each interpreter times its own import with ``time.perf_counter`` (interpreter start-up
is not counted). The median of the runs is printed for each, and sdkcore's own share
as the difference of the first two medians. ``sdkcore`` and attrs are compiled to
bytecode first (``compileall``): with ``PYTHONDONTWRITEBYTECODE`` set, or in a fresh
environment, every run would otherwise time the compiler (attrs alone: about 48 ms
from source against 29 ms from bytecode on a 2-core machine).

``--tree DIR`` imports the ``sdkcore`` package found in DIR instead of this checkout's
(e.g. an older commit unpacked with ``git archive <commit> sdkcore | tar -x -C DIR``);
given more than once, the trees' runs are interleaved too, to compare before and after
in one session against the same ``import attrs`` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

VARIANTS = {  # name: (imported first, untimed; timed)
    "import attrs": ("", "import attrs"),
    "import sdkcore": ("", "import sdkcore"),
    "import sdkcore after attrs": ("import attrs", "import sdkcore"),
    "import sdkcore after asyncio": ("import attrs, asyncio", "import sdkcore"),
}
TIMED = (
    "{before}\nimport time\nt = time.perf_counter()\n{stmt}\n"
    "print((time.perf_counter() - t) * 1e3)\n"
)
ATTRS = "import attr, attrs, os\nfor m in (attr, attrs): print(os.path.dirname(m.__file__))"
CHECK = (
    "import os, sdkcore\nprint(os.path.dirname(os.path.dirname(os.path.abspath(sdkcore.__file__))))"
)


def run_ms(code: str, tree: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh processes per variant")
    parser.add_argument(
        "--tree",
        action="append",
        help="directory holding the sdkcore package to import; repeat to compare trees "
        "in one interleaved session (default: this checkout)",
    )
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [os.path.abspath(t) for t in args.tree or [here]]

    attrs_dirs = subprocess.run(
        [sys.executable, "-c", ATTRS], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    subprocess.run([sys.executable, "-m", "compileall", "-q", *attrs_dirs], check=True)
    for tree in trees:
        # ``python -c`` puts the working directory first on sys.path: make sure it wins.
        found = subprocess.run(
            [sys.executable, "-c", CHECK], cwd=tree, capture_output=True, text=True, check=True
        ).stdout.strip()
        if found != tree:
            sys.exit(f"sdkcore imports from {found}, not from {tree}")
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", os.path.join(tree, "sdkcore")], check=True
        )

    # (tree, variant); ``import attrs`` does not depend on the tree: run once per round
    cases = [(trees[0], "import attrs")] + [
        (tree, name) for tree in trees for name in VARIANTS if name != "import attrs"
    ]
    codes = {
        name: TIMED.format(before=before, stmt=stmt) for name, (before, stmt) in VARIANTS.items()
    }
    for tree, name in cases:  # warm the file system cache
        run_ms(codes[name], tree)
    samples: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    for i in range(args.runs):
        for tree, name in cases if i % 2 == 0 else reversed(cases):
            samples[tree, name].append(run_ms(codes[name], tree))

    med = {case: statistics.median(values) for case, values in samples.items()}
    print(f"Python {sys.version.split()[0]}; median of {args.runs} fresh processes each, ms")
    attrs_case = (trees[0], "import attrs")
    values = samples[attrs_case]
    print(
        f"  {'import attrs':<28} {med[attrs_case]:6.1f}   "
        f"(min {min(values):5.1f}, max {max(values):5.1f})"
    )
    for tree in trees:
        print(f"sdkcore from {tree}")
        for name in VARIANTS:
            if name == "import attrs":
                continue
            values = samples[tree, name]
            print(
                f"  {name:<28} {med[tree, name]:6.1f}   "
                f"(min {min(values):5.1f}, max {max(values):5.1f})"
            )
        share = med[tree, "import sdkcore"] - med[attrs_case]
        print(f"  {'sdkcore own share':<28} {share:6.1f}   (import sdkcore - import attrs)")


if __name__ == "__main__":
    main()
