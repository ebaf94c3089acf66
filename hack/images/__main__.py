"""python3 -m hack.images build [pause|base|operator|trainer|torch|all ...]   # default: all
python3 -m hack.images show [--json]     # refs, archives and whether each is built; builds nothing

Run from the repository root. Prints one line per image: name, ref, archive, size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from hack.images.cache import BuildError
from hack.images.ensure import NAMES, Image, ensure_images, planned_images


def describe(image: Image) -> str:
    if image.archive.exists():
        size = f"{image.archive.stat().st_size / 2**20:.0f} MiB"
    else:
        size = "not built"
    return f"{image.name:9} {image.ref:32} {image.archive} ({size})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m hack.images",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build what is missing, print the images")
    build.add_argument("names", nargs="*", metavar="NAME",
                       help=f"{', '.join(NAMES)} or all (the default)")
    show = sub.add_parser("show", help="print the images' refs and archives; build nothing")
    show.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    if args.command == "show":
        images = planned_images()
        if args.json:
            print(json.dumps({n: {"ref": i.ref, "archive": str(i.archive),
                                  "input_hash": i.input_hash, "built": i.archive.exists()}
                              for n, i in images.items()}, indent=2))
        else:
            print("\n".join(describe(i) for i in images.values()))
        return 0

    names = NAMES if not args.names or "all" in args.names else args.names
    if unknown := set(names) - set(NAMES):
        parser.error(f"unknown images: {', '.join(sorted(unknown))}")
    start = time.monotonic()
    try:
        images = ensure_images(names)
    except BuildError as err:
        print(f"hack.images: {err}", file=sys.stderr)
        return 1
    print("\n".join(describe(i) for i in images.values()))
    print(f"({time.monotonic() - start:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
