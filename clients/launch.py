"""Start the forkrl stack locally, without Docker: the same services, commands and settings as compose.yaml.

    python clients/launch.py                         # model (one-shot), rollout, trainer, probe
    python clients/launch.py rollout probe           # a subset (dependencies come along)
    ROLLOUT_PORT=50061 python clients/launch.py      # the variables compose.yaml reads work here too
    python clients/launch.py --print                 # show the resolved commands and exit

compose.yaml is read for each service's command, environment, depends_on and healthcheck; data paths
(`${FORKRL_DATA:-/data}` there) go to --data-dir. Services start in dependency order, each waiting for
what it depends on (healthy / completed), and their logs stream here as `[rollout] ...` (also written to
<data-dir>/logs/<service>.log). Ctrl-C or SIGTERM stops them all, dependents first (SIGTERM, then SIGKILL
after the service's stop_grace_period); so does the death of any one of them (no `restart:` here). Every
service requires one bearer token: FORKRL_TOKEN when set, else the one compose.yaml's `token` service creates
in <data-dir>/secrets/token (clients: `export FORKRL_TOKEN_FILE=<data-dir>/secrets/token`). Exit status: 0 after a
requested stop, non-zero when a service failed to start or died. From Python: clients/stack.py (Stack).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


class _Terminate(Exception):
    pass


def _on_signal(signum, frame):  # noqa: ARG001
    name = signal.Signals(signum).name
    print(f"[launch] {name}: stopping", flush=True)
    raise _Terminate(name)


def _on_sigint(signum, frame):  # noqa: ARG001
    print("[launch] SIGINT: stopping", flush=True)
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python clients/launch.py",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("services", nargs="*", help="services to start (default: all in the compose file)")
    parser.add_argument(
        "-f",
        "--file",
        action="append",
        dest="files",
        metavar="COMPOSE_FILE",
        help="compose file; repeat for overrides, merged in order (default: compose.yaml)",
    )
    parser.add_argument(
        "--data-dir", default=None, help="local directory for ${FORKRL_DATA} (default: $FORKRL_DATA, else runs/stack)"
    )
    parser.add_argument(
        "-e",
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a variable for interpolation and for the services (repeatable)",
    )
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter that runs `python` commands (default: this one)"
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds for the stack to become ready (default: 900)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=None,
        help="seconds between SIGTERM and SIGKILL (default: each service's stop_grace_period)",
    )
    parser.add_argument("--quiet", action="store_true", help="do not stream service logs (files only)")
    parser.add_argument("--print", action="store_true", dest="print_only", help="print the resolved services and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from clients.stack import Stack, StackError

    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"launch.py: --env expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        env[key] = value
    try:
        stack = Stack(
            services=args.services or None,
            compose_files=args.files,
            data_dir=args.data_dir,
            env=env,
            python=args.python,
            echo="launch" if args.quiet else True,
            timeout=args.timeout,
            grace_s=args.grace,
        )
    except StackError as err:
        print(f"launch.py: {err}", file=sys.stderr)
        return 2
    if args.print_only:
        print(stack.describe())
        return 0

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    signal.signal(signal.SIGINT, _on_sigint)
    code = 0
    try:
        stack.start()
        where = ", ".join(f"{n} {a}" for n, a in stack.addresses.items())
        stack.say("launch", f"ready in {stack.ready_s:.1f} s: {where} (data: {stack.data_dir}); Ctrl-C stops")
        if not stack.base_env.get("FORKRL_TOKEN", "").strip() and stack.token_file.is_file():
            stack.say("launch", f"clients need the services' token: export FORKRL_TOKEN_FILE={stack.token_file}")
        code = stack.wait()
    except (KeyboardInterrupt, _Terminate):
        pass
    except StackError as err:
        stack.say("launch", f"error: {err}")
        code = 1
    finally:
        stack.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
