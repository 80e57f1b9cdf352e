"""`python -m checkpoint verify PATH...`: check step folders without loading them."""

from __future__ import annotations

from pathlib import Path

from checkpoint.checksums import MANIFEST
from checkpoint.folder import check_folder


def main(argv: list[str]) -> int:
    """`python -m checkpoint verify PATH...`: OK or damaged per step (a PATH that does not exist: not found), exit
    status 0 when all are OK, else 2."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m checkpoint", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "verify", help="check step folders (or every step of a checkpoint folder) against their checksums"
    )
    check.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    opts = parser.parse_args(argv)
    checked, missing = [], []
    for path in opts.paths:
        if not path.exists():
            missing.append(path)
            print(f"{path}: not found", flush=True)
            continue
        for step, problem in check_folder(path):
            checked.append(problem)
            if problem is None:
                whole = (step / MANIFEST).is_file()
                print(f"{step}: OK" + ("" if whole else f" (sizes only: no {MANIFEST})"), flush=True)
            else:
                print(f"{step}: damaged: {problem}", flush=True)
    if not checked and len(missing) < len(opts.paths):
        print(f"{', '.join(str(p) for p in opts.paths if p not in missing)}: no checkpoint found", flush=True)
    return 0 if checked and not missing and all(problem is None for problem in checked) else 2


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
