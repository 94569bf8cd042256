"""The weight push against the link: the transfer route across simulated hosts with shaped links (root only).

    sudo env PYTHONPATH=$PWD .venv/bin/python bench/bench_link.py         # 2 sizes x 2 rates x 1 and 2 hosts
    sudo env PYTHONPATH=$PWD python bench/bench_link.py --sizes 400m --rates 1gbit    # one size, one rate

A simulated cluster (scripts/cluster_sim.py, 3 hosts): the trainer-side pusher on fk-host1 (this script's `push`
mode: the trainer's own code, `Rollouts.push(model, v, "transfer", ...)`, TRAINER_TRANSFER_ADDRESS = fk-host1's
address), a rollout service (vLLM, TLS with a CA this script makes, the token) on fk-host2 and on fk-host3. The weight
channel is the authenticated gloo group of forkrl/weights/transfer_gloo.py (per-group secret over gRPC, keyed BLAKE3
per chunk). Each model is a random-init Qwen2 (forkrl/models/random_qwen2.py: 400m = 0.43 GB, 1.5g = 1.50 GB
fp32) in .cache/bench-models/.

Per model, per target set (fk-host2 alone; fk-host2 and fk-host3: one broadcast to both), one unshaped warm-up push
forms the group (outside the timings); then per rate every host's egress is shaped with tc tbf (the trainer's
link and each rollout host's own) and one push is timed as the trainer sees it (StartWeightUpdate .. Finish). Printed
per case: the pushed bytes, the time, achieved Gbit/s (pushed bytes x receivers / time), time / (bytes / rate) (the
floor of one receiver's link), the bytes that left each host during the push (the qdisc's counters: which link
carried the broadcast, and how often), and the trainer's peak extra memory (its peak RSS during the push above its
RSS before: /proc/self/clear_refs, VmHWM). gloo's broadcast from one sender to two receivers sends the bytes once
per receiver over the sender's link (a receiver forwards nothing: see the per-host counters), so with the sender's
egress shaped at the same rate the two-host floor is twice the one-host floor; the table prints both ratios.
The machine's other load shows in every number: say so with them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN_ID = "bench-link"
TARGETS = (("fk-host2",), ("fk-host2", "fk-host3"))


def _rate_bits(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate)
    if not m:
        raise ValueError(f"--rates: a tc rate in bit/s such as 1gbit or 500mbit, got {rate!r}")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9, None: 1.0}[m.group(2)]


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def pusher(model_dir: str) -> int:
    """`push` mode (on the trainer's host): reads `targets ADDR,ADDR` / `push` / `quit` lines, prints JSON lines."""
    import torch
    from transformers import AutoModelForCausalLM

    from forkrl.training.rollouts import Rollouts

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rollouts: Rollouts | None = None
    version = 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "targets":
            if rollouts is not None:
                rollouts.close()
            rollouts = Rollouts(arg.split(","), run_id=RUN_ID)
            print(json.dumps({"targets": arg}), flush=True)
        elif cmd == "push":
            assert rollouts is not None
            version += 1
            Path("/proc/self/clear_refs").write_text("5")  # the peak RSS restarts from the current one
            before = _kib("VmRSS")
            t0 = time.perf_counter()
            rollouts.push(model, version, "transfer", Path(tempfile.gettempdir()))
            seconds = time.perf_counter() - t0
            served = [c.info().version for c in rollouts.clients]
            print(json.dumps({"seconds": seconds, "extra_mib": (_kib("VmHWM") - before) / 1024, "served": served,
                              "version": version, **rollouts.last_transfer}), flush=True)
        elif cmd == "quit":
            break
    if rollouts is not None:
        rollouts.close()
    return 0


def wait_ready(address: str) -> int:
    """`wait` mode (on the trainer's host): until the service at `address` is ready (TLS, token)."""
    from forkrl.remote.rollout import RolloutClient

    with RolloutClient(address, timeout_s=120) as client:
        client.wait_ready(timeout_s=600)
    return 0


def _sent_bytes(cluster: object, host: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", host, "tc", "-s", "qdisc", "show", "dev", "eth0"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in re.findall(r"Sent (\d+) bytes", out))


def bench(args: argparse.Namespace) -> list[dict]:
    from forkrl.models.random_qwen2 import build_random_qwen2
    from scripts.cluster_sim import Cluster
    from tests.pki import make_pki
    from tests.service_fixtures import start_rollout_service

    work = Path(tempfile.mkdtemp(prefix="bench-link-"))
    os.environ.setdefault("FORKRL_TOKEN", "bench-link-" + secrets.token_hex(8))
    rows: list[dict] = []
    with Cluster(3) as cluster:
        hosts = cluster.names()
        addr = {h: cluster.address(h) for h in hosts}
        pki = make_pki(work / "pki", names=(*hosts[1:], *(addr[h] for h in hosts[1:])))
        env = {**os.environ, "FORKRL_TLS_CA": pki["ca"], "TRAINER_TRANSFER_ADDRESS": addr["fk-host1"],
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
        me = [sys.executable, str(Path(__file__).resolve())]

        def ready(service: str) -> None:
            cluster.run("fk-host1", [*me, "wait", service], env=env, check=True, timeout=900)

        for size in args.sizes.split(","):
            model = build_random_qwen2(ROOT / ".cache" / "bench-models" / f"qwen2-{size}", size)
            with start_rollout_service(model, log_path=work / f"{size}-host2.log", kv_cache_gib=1, seed=0,
                                       host=addr["fk-host2"], tls_cert_file=pki["cert"], tls_key_file=pki["key"],
                                       staging_dir=work / "staging2", launcher=cluster.argv("fk-host2", []),
                                       ready=ready, startup_timeout_s=900) as s2, \
                    start_rollout_service(model, log_path=work / f"{size}-host3.log", kv_cache_gib=1, seed=0,
                                          host=addr["fk-host3"], tls_cert_file=pki["cert"], tls_key_file=pki["key"],
                                          staging_dir=work / "staging3", launcher=cluster.argv("fk-host3", []),
                                          ready=ready, startup_timeout_s=900) as s3:
                service = {"fk-host2": str(s2), "fk-host3": str(s3)}
                proc = cluster.popen("fk-host1", [*me, "push", "--model", str(model)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

                def ask(line: str, proc: subprocess.Popen = proc) -> dict:
                    proc.stdin.write(line + "\n")  # type: ignore[union-attr]
                    proc.stdin.flush()  # type: ignore[union-attr]
                    return _reply(proc)

                try:
                    _reply(proc)  # model loaded
                    for targets in TARGETS:
                        ask("targets " + ",".join(service[h] for h in targets))
                        warm = ask("push")  # forms the group; unshaped
                        print(f"{size} -> {'+'.join(targets)}: warm-up push {warm['seconds']:.1f} s", flush=True)
                        for rate in args.rates.split(","):
                            for h in hosts:
                                cluster.shape(h, rate)
                            sent0 = {h: _sent_bytes(cluster, h) for h in hosts}
                            r = ask("push")
                            sent = {h: _sent_bytes(cluster, h) - sent0[h] for h in hosts}
                            for h in hosts:
                                cluster.shape(h, "off")
                            rows.append(_row(size, targets, rate, r, sent))
                            print(_fmt(rows[-1]), flush=True)
                    proc.stdin.write("quit\n")  # type: ignore[union-attr]
                    proc.stdin.close()  # type: ignore[union-attr]
                finally:
                    if proc.poll() is None:
                        proc.kill()
                    proc.wait()
    return rows


def _reply(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise RuntimeError(f"the pusher on fk-host1 exited ({proc.wait()}) without a reply")
    return json.loads(line)


def _row(size: str, targets: tuple[str, ...], rate: str, r: dict, sent: dict[str, int]) -> dict:
    nbytes, n = r["bytes"], len(targets)
    floor = nbytes * 8 / _rate_bits(rate)
    return {"size": size, "hosts": n, "rate": rate, "bytes": nbytes, "seconds": r["seconds"],
            "gbit_s": nbytes * n * 8 / r["seconds"] / 1e9, "ratio": r["seconds"] / floor,
            "ratio_sender": r["seconds"] / (floor * n), "extra_mib": r["extra_mib"],
            "sent_gb": {h: round(b / 1e9, 3) for h, b in sent.items()}, "served": r["served"]}


HEADER = ("| model | hosts | link | bytes | time s | Gbit/s (all receivers) | time / (bytes / rate) | "
          "time / (hosts x bytes / rate) | GB out of host1 / host2 / host3 | trainer peak extra MiB |")


def _fmt(row: dict) -> str:
    sent = " / ".join(f"{v:.2f}" for v in row["sent_gb"].values())
    return (f"| {row['size']} | {row['hosts']} | {row['rate']} | {row['bytes'] / 2**20:.0f} MiB | "
            f"{row['seconds']:.1f} | {row['gbit_s']:.2f} | {row['ratio']:.2f} | {row['ratio_sender']:.2f} | {sent} | "
            f"{row['extra_mib']:.0f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode")
    push = sub.add_parser("push", help="(internal) the pusher, on the trainer's host")
    push.add_argument("--model", required=True)
    sub.add_parser("wait", help="(internal) wait for a service").add_argument("address")
    p.add_argument("--sizes", default="400m,1.5g", help="random_qwen2 sizes, comma-separated")
    p.add_argument("--rates", default="1gbit,4gbit", help="tc rates, comma-separated")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the pusher and the services")
    args = p.parse_args()
    if args.mode == "push":
        return pusher(args.model)
    if args.mode == "wait":
        return wait_ready(args.address)
    for rate in args.rates.split(","):
        _rate_bits(rate)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    rows = bench(args)
    print(f"\n{started}, commit {commit}, load average {os.getloadavg()[0]:.1f} at the end\n{HEADER}\n"
          + "|---" * 10 + "|")
    for row in rows:
        print(_fmt(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
