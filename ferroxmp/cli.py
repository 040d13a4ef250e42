"""The `ferroxmp` console script: `ferroxmp serve [FLAGS]` or `ferroxmp router [FLAGS]`."""
from __future__ import annotations

import sys

USAGE = ("usage: ferroxmp serve [FLAGS]    an inference server (ferroxmp serve --help)\n"
         "       ferroxmp router [FLAGS]   one address in front of several servers (ferroxmp router --help)")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    if argv[0] == "serve":
        from ferroxmp.config import parse_server_args
        from ferroxmp.supervisor import serve
        raise SystemExit(serve(parse_server_args(argv[1:])))
    if argv[0] == "router":
        from ferroxmp.router.args import parse_router_args
        from ferroxmp.router.server import run_router
        raise SystemExit(run_router(parse_router_args(argv[1:])))
    print(f"ferroxmp: unknown command {argv[0]!r}; the commands are 'serve' and 'router'", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
