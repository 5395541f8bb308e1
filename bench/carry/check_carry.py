"""Checks a carry once unpacked on the machine it went to: every requirement of the carried distributions is met
(by the carry or by the machine's own packages), and the modules a program needs import. One line per problem.

    python3 check_carry.py NAME --dists ray,torchft --modules ray,megatron.core   # named distributions
    python3 check_carry.py NAME --site /tmp/sglang-site --skip sglang --modules sglang.launch_server  # all in SITE
"""

import argparse
import importlib
import importlib.metadata as md

from packaging.requirements import Requirement


def unmet(name: str) -> list[str]:
    problems = []
    for line in md.requires(name) or []:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{name} needs {req}: not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{name} needs {req}: have {have}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name", help="who is checking (the install script), for the messages")
    parser.add_argument("--dists", default="", help="the carried distributions, comma-separated")
    parser.add_argument("--site", help="or every distribution in this folder")
    parser.add_argument("--skip", default="", help="distributions whose requirements name packages not carried")
    parser.add_argument("--modules", default="", help="modules that must import, comma-separated")
    args = parser.parse_args()
    dists = [d for d in args.dists.split(",") if d]
    if args.site:
        dists += [dist.metadata["Name"] for dist in md.distributions(path=[args.site])]
    skip = {d.lower() for d in args.skip.split(",") if d}
    problems = [p for name in dists if name.lower() not in skip for p in unmet(name)]
    for module in filter(None, args.modules.split(",")):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001  (any failure to import is the finding)
            problems.append(f"import {module}: {type(e).__name__}: {e}")
    print("\n".join(f"{args.name}: WARNING {p}" for p in problems)
          or f"{args.name}: the carried packages import; their requirements are met")


if __name__ == "__main__":
    main()
