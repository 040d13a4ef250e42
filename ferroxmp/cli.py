"""The `ferroxmp` console script: `ferroxmp serve [FLAGS]`."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ferroxmp serve [FLAGS]   (ferroxmp serve --help lists every flag)")
        raise SystemExit(0 if argv else 2)
    if argv[0] != "serve":
        print(f"ferroxmp: unknown command {argv[0]!r}; the command is 'serve'", file=sys.stderr)
        raise SystemExit(2)
    from ferroxmp.config import parse_server_args
    from ferroxmp.supervisor import serve
    raise SystemExit(serve(parse_server_args(argv[1:])))


if __name__ == "__main__":
    main()
