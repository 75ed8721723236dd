"""The `parallax` command: `parallax run ...`, `parallax server ...`, `parallax demo ...`,
`parallax version` (or `--version`). A ParallaxError from a command is one line on stderr
(exit 2 for a configuration mistake, 1 otherwise), not a traceback; an InternalError (a bug
in parallax) keeps its traceback, which a report needs."""
from __future__ import annotations

import sys

from parallax.errors import ConfigError, InternalError, ParallaxError
from parallax.version import PROTOCOL_VERSION, __version__


def _run(argv: list[str]) -> int:
    from parallax.launch.run import main as launch_main
    return launch_main(argv)


def _server(argv: list[str]) -> int:
    from parallax_ps.server import main as server_main
    return server_main(argv)


def _demo(argv: list[str]) -> int:
    from parallax.launch.demo import main as demo_main
    return demo_main(argv)


def _ps_demo(argv: list[str]) -> int:
    from parallax.launch.ps_demo import main as ps_demo_main
    return ps_demo_main(argv)


def _status(argv: list[str]) -> int:
    from parallax.launch.status import main as status_main
    return status_main(argv)


def _k8s(argv: list[str]) -> int:
    from parallax.launch.k8s import main as k8s_main
    return k8s_main(argv)


def _bench(argv: list[str]) -> int:
    from parallax.bench.command import main as bench_main
    return bench_main(argv)


def _version(argv: list[str]) -> int:
    print(f"parallax {__version__} (wire protocol parallax.ps.v{PROTOCOL_VERSION})")
    return 0


COMMANDS = {
    "run": (_run, "start parameter servers and N Horovod workers (parallax run --help)"),
    "server": (_server, "run a parameter server (parallax server --help)"),
    "demo": (_demo, "the main job: train the WordNet language model on 2 workers + 2 servers"),
    "ps-demo": (_ps_demo, "start parameter servers and run a client round trip"),
    "status": (_status, "health and per-table stats of a job's servers (parallax status "
                        "--help)"),
    "k8s": (_k8s, "render Kubernetes manifests for a job (parallax k8s --help)"),
    "bench": (_bench, "benchmark parallax against TF PS, MWMS and Horovod (parallax bench "
                      "--help)"),
    "version": (_version, "print versions"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):
        return _version(argv[1:])
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = "\n".join(f"  {name:<10}{help_}" for name, (_, help_) in COMMANDS.items())
        stream = sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr
        if argv and argv[0] not in ("-h", "--help"):
            print(f"parallax: unknown command {argv[0]!r}", file=stream)
        print(f"usage: parallax COMMAND [ARGS]\n\ncommands:\n{lines}", file=stream)
        return 0 if stream is sys.stdout else 2
    handler, _ = COMMANDS[argv[0]]
    try:
        return handler(argv[1:])
    except InternalError:  # a bug in parallax: its traceback is what the report needs
        raise
    except ParallaxError as exc:  # a user's mistake or a job's failure: one line, no traceback
        print(f"parallax {argv[0]}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
