"""Start (or join) an RL run on the trainer service and follow it with a progress bar.

    python clients/start_run.py --entropy-top-frac 0.2                 # train on the embedded default
    python clients/start_run.py --loss dapo --num-steps 200 --save-every 50
    python clients/start_run.py --dataset data/gsm8k.jsonl --model /models/Qwen2.5-0.5B-Instruct
    python clients/start_run.py --detach ...        # print the run id and return
    python clients/start_run.py --watch RUN_ID      # follow a run that is already going

Every training flag maps 1:1 to a field of RunConfig (forkrl/training/config.py) and of the StartRun message; the
flags are generated from that model (its field docstrings are the --help). `--config run.toml` reads the same
fields from a file, and flags override it. Bad values are rejected here, before anything is sent. Ctrl-C asks
whether to stop the run or detach.
The trainer's token is read from FORKRL_TOKEN, else from the file FORKRL_TOKEN_FILE names (see docs/security.md);
with FORKRL_TLS_CA set (a trainer serving TLS) the call goes over TLS, trusting that CA.
Exit status: 0 when the run succeeded (or was stopped on request / detached), 1 when it failed, 2 for bad flags.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pydantic import Field  # noqa: E402
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict  # noqa: E402

from forkrl.cli import CliSettings, NamedEnvSource, parse_settings  # noqa: E402
from forkrl.training.config import RunConfig, to_proto  # noqa: E402

# Defaults the client takes from the environment (flags and --config override them).
ENV_DEFAULTS = {
    "entropy_top_frac": "ENTROPY_TOP_FRAC",
    "dataset": "RL_DATASET_PATH",
    "trainer_address": "TRAINER_ADDRESS",
}


class StartRunArgs(CliSettings, RunConfig):
    """Start (or join) an RL run on the trainer service and follow it; the last five flags are the client's."""

    model_config = SettingsConfigDict(cli_prog_name="python clients/start_run.py")

    trainer_address: str = "127.0.0.1:50052"
    """Trainer service host:port (env TRAINER_ADDRESS)."""
    detach: bool = False
    """Start the run, print its id and return."""
    watch: str = ""
    """RUN_ID: follow this run (already started) instead of starting one."""
    connect_timeout_s: float = Field(60.0, gt=0)
    """How long to wait for the trainer to become healthy."""
    config: str = ""
    """TOML file of run settings (field names as keys, e.g. entropy_top_frac = 0.2); flags override it."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags (CliApp puts them first) > the --config file (init values) > ENV_DEFAULTS > field defaults
        return init_settings, NamedEnvSource(settings_cls, ENV_DEFAULTS)

    def run_config(self) -> RunConfig:
        return RunConfig(**self.model_dump(include=set(RunConfig.model_fields)))


def read_config_file(argv: list[str]) -> dict[str, Any]:
    """The settings of `--config FILE` (read before the flags are parsed, so that the flags override it)."""
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if "--config" in argv[:-1]:
        path = argv[argv.index("--config") + 1]
    if not path:
        return {}
    prog = StartRunArgs.model_config["cli_prog_name"]
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        print(f"{prog}: error: --config needs Python >= 3.11 (tomllib)", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as err:
        print(f"{prog}: error: --config {path}: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_args(argv: list[str] | None = None) -> StartRunArgs:
    """Flags > --config file > ENV_DEFAULTS > defaults; exits 2 naming the flag and value when invalid."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return parse_settings(StartRunArgs, argv, **read_config_file(argv))


def _fmt(values: dict, key: str, spec: str) -> str:
    return format(values[key], spec) if key in values else "-"


def _in_background(stream):
    """The stream's items, read by a daemon thread: the main thread waits on a queue in short slices, so a
    Ctrl-C (KeyboardInterrupt) arrives here, in our code, never inside gRPC's own locks (where it could leave
    the stream's lock held and the cancel that follows would hang). The reader's RpcError is re-raised."""
    items: queue.Queue = queue.Queue()
    done = object()

    def read() -> None:
        try:
            for item in stream:
                items.put(item)
        except Exception as exc:  # grpc.RpcError (also the CANCELLED after our own cancel)
            items.put(exc)
        items.put(done)

    threading.Thread(target=read, name="watch-run", daemon=True).start()
    while True:
        try:
            item = items.get(timeout=0.2)
        except queue.Empty:
            continue
        if item is done:
            return
        if isinstance(item, Exception):
            raise item
        yield item


def follow(stub, pb2, run_id: str, num_steps: int, start_step: int, detach_hint: bool = True) -> int:
    """Stream WatchRun into a progress bar; returns the exit status."""
    import grpc
    from tqdm import tqdm

    bar = tqdm(total=num_steps, initial=start_step, unit="step", dynamic_ncols=True, desc=run_id[-6:])
    final_state, error = None, ""
    stream = stub.WatchRun(pb2.WatchRunRequest(run_id=run_id))
    try:
        for item in _in_background(stream):
            if item.HasField("metrics"):
                m = item.metrics
                v = dict(m.values)
                bar.n = m.step
                bar.set_postfix_str(
                    f"reward {_fmt(v, 'reward_mean', '.3f')} acc {_fmt(v, 'accuracy', '.3f')} "
                    f"kept {_fmt(v, 'kept_frac', '.3f')} {_fmt(v, 'time_step_s', '.2f')}s/step", refresh=False)
                bar.refresh()
            else:
                ev = item.event
                kind = pb2.EventKind.Name(ev.kind).removeprefix("EVENT_KIND_").lower()
                extra = " ".join(f"{k}={v:.4g}" for k, v in sorted(ev.values.items()))
                text = f"[{kind} step {ev.step}] {ev.message} {extra} {ev.path}".rstrip()
                bar.write(text)
                if ev.kind == pb2.EVENT_KIND_FINISHED:
                    final_state = pb2.RunState.Name(ev.state).removeprefix("RUN_STATE_")
                    error = ev.message
    except KeyboardInterrupt:
        bar.close()
        stream.cancel()
        return ask_stop_or_detach(stub, pb2, run_id, num_steps)
    except grpc.RpcError as err:
        bar.close()
        print(f"start_run.py: lost the trainer: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    bar.close()
    if final_state == "FAILED":
        print(f"start_run.py: run {run_id} FAILED: {error}", file=sys.stderr)
        return 1
    print(f"run {run_id} {final_state.lower() if final_state else 'ended'}")
    return 0


def ask_stop_or_detach(stub, pb2, run_id: str, num_steps: int) -> int:
    answer = "d"
    if sys.stdin.isatty():
        try:
            answer = input("\nStop the run (writes a checkpoint) or detach? [s/d] ").strip().lower()[:1] or "d"
        except (EOFError, KeyboardInterrupt):
            answer = "d"
    if answer == "s":
        stub.StopRun(pb2.StopRunRequest(run_id=run_id), timeout=30)
        print(f"stopping run {run_id}: it stops before its next micro-batch or Generate call and checkpoints "
              "its last trained step")
        run = stub.GetRun(pb2.GetRunRequest(run_id=run_id), timeout=30)
        return follow(stub, pb2, run_id, num_steps, run.step)
    print(f"detached; the run goes on. Follow it again with: python clients/start_run.py --watch {run_id}")
    return 0


def _take_ctrl_c() -> None:
    """Ctrl-C must reach this client (stop or detach): a SIGINT ignored or blocked by whatever started the
    process (both are inherited across exec; seen when started from a long-lived test process) is
    restored to Python's KeyboardInterrupt."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def main(argv: list[str] | None = None) -> int:
    _take_ctrl_c()
    args = parse_args(argv)
    config = args.run_config()

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from forkrl.remote.channel import grpc_channel
    from forkrl.wire.trainer.v1 import trainer_pb2 as pb2
    from forkrl.wire.trainer.v1 import trainer_pb2_grpc

    channel = grpc_channel(args.trainer_address)  # FORKRL_TOKEN / FORKRL_TOKEN_FILE's token; TLS with FORKRL_TLS_CA
    health_stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + args.connect_timeout_s
    while True:  # wait for health before the first call; retry only UNAVAILABLE
        try:
            resp = health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError as err:
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
        if time.monotonic() > deadline:
            print(f"start_run.py: trainer at {args.trainer_address} not healthy after {args.connect_timeout_s:.0f}s",
                  file=sys.stderr)
            return 1
        time.sleep(0.5)

    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    if args.watch:
        run = stub.GetRun(pb2.GetRunRequest(run_id=args.watch), timeout=30)
        return follow(stub, pb2, run.run_id, run.num_steps, run.step)
    try:
        started = stub.StartRun(pb2.StartRunRequest(config=to_proto(config)), timeout=120)
    except grpc.RpcError as err:
        print(f"start_run.py: StartRun refused: {err.code().name}: {err.details()}", file=sys.stderr)
        return 2 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    print(f"run {started.run_id} started in {started.run_dir} (from step {started.start_step})", flush=True)
    if args.detach:
        print(started.run_id)
        return 0
    return follow(stub, pb2, started.run_id, config.num_steps, started.start_step)


if __name__ == "__main__":
    sys.exit(main())
