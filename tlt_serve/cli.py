"""``tlt-serve``: one entry, ``serve`` (one server) or ``fleet`` (replicas behind
sglang-router)."""

from __future__ import annotations

import sys

USAGE = """usage: tlt-serve {serve,fleet} ...

  serve   serve a model over HTTP (SGLang-native and OpenAI APIs): tlt-serve serve --help
  fleet   N replicas behind sglang-router: tlt-serve fleet --help
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "serve":
        from tlt_serve.flags import parse
        from tlt_serve.server.serve import serve

        return serve(parse(rest))
    if command == "fleet":
        from tlt_serve.fleet.launch import main as fleet_main

        return fleet_main(rest)
    if command in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    print(USAGE, end="", file=sys.stderr)
    print(f"tlt-serve: choose serve or fleet{f', not {command!r}' if command else ''}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
