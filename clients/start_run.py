"""Start (or join) an RL run on the trainer service and follow it with a progress bar.

    python clients/start_run.py --entropy-top-frac 0.2                 # train on the embedded default
    python clients/start_run.py --loss dapo --num-steps 200 --save-every 50
    python clients/start_run.py --dataset data/gsm8k.jsonl --model /models/Qwen2.5-0.5B-Instruct
    python clients/start_run.py --detach ...        # print the run id and return
    python clients/start_run.py --watch RUN_ID      # follow a run that is already going

Every training flag maps 1:1 to a field of RunConfig (forkrl/training/config.py) and of the StartRun message.
Bad values are rejected here, before anything is sent. Ctrl-C asks whether to stop the run or detach.
Exit status: 0 when the run succeeded (or was stopped on request / detached), 1 when it failed, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pydantic import ValidationError  # noqa: E402

from forkrl.training.config import RunConfig, describe_validation_error, to_proto  # noqa: E402

CLIENT_FLAGS = ("trainer_address", "detach", "watch", "connect_timeout_s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python clients/start_run.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train = parser.add_argument_group("run configuration (sent to the trainer)")
    defaults = RunConfig()  # resolves env defaults (ENTROPY_TOP_FRAC, RL_DATASET_PATH) for the help text
    for name, field in RunConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        ann = field.annotation
        default = getattr(defaults, name)
        kw: dict = {"help": field.description, "default": argparse.SUPPRESS}
        if ann is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(ann) is typing.Literal:
            kw["choices"] = typing.get_args(ann)
        elif name == "rollout_addresses":
            kw["nargs"] = "+"
            kw["metavar"] = "HOST:PORT"
        else:
            base = [a for a in typing.get_args(ann) if a is not type(None)] or [ann]
            kw["type"] = base[0]
        kw["help"] = f"{field.description} [default: {default}]"
        train.add_argument(flag, **kw)
    client = parser.add_argument_group("client")
    client.add_argument("--trainer-address", default=os.environ.get("TRAINER_ADDRESS", "127.0.0.1:50052"),
                        help="trainer service host:port (env TRAINER_ADDRESS)")
    client.add_argument("--detach", action="store_true", help="start the run, print its id and return")
    client.add_argument("--watch", metavar="RUN_ID", help="follow an existing run instead of starting one")
    client.add_argument("--connect-timeout-s", type=float, default=60.0,
                        help="how long to wait for the trainer to become healthy")
    return parser


def parse_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, RunConfig]:
    args = parser.parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if k not in CLIENT_FLAGS}
    try:
        config = RunConfig(**fields)
    except ValidationError as err:
        parser.exit(2, f"start_run.py: error: {describe_validation_error(err)}\n")
    return args, config


def _fmt(values: dict, key: str, spec: str) -> str:
    return format(values[key], spec) if key in values else "-"


def follow(stub, pb2, run_id: str, num_steps: int, start_step: int, detach_hint: bool = True) -> int:
    """Stream WatchRun into a progress bar; returns the exit status."""
    import grpc
    from tqdm import tqdm

    bar = tqdm(total=num_steps, initial=start_step, unit="step", dynamic_ncols=True, desc=run_id[-6:])
    final_state, error = None, ""
    stream = stub.WatchRun(pb2.WatchRunRequest(run_id=run_id))
    try:
        for item in stream:
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
        print(f"stopping run {run_id}: it finishes the current step and checkpoints")
        run = stub.GetRun(pb2.GetRunRequest(run_id=run_id), timeout=30)
        return follow(stub, pb2, run_id, num_steps, run.step)
    print(f"detached; the run goes on. Follow it again with: python clients/start_run.py --watch {run_id}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, config = parse_config(parser, argv)

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from forkrl.wire.trainer.v1 import trainer_pb2 as pb2
    from forkrl.wire.trainer.v1 import trainer_pb2_grpc

    channel = grpc.insecure_channel(args.trainer_address)
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
