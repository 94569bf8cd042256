"""A trainer process for tests/rollout/test_weight_transfer.py: pushes weights into a rollout service through the
gloo weight-transfer backend (forkrl/weights/transfer_gloo.py), with the trainer's own code (`Rollouts.push`,
--weight-sync transfer), from a process of its own.

    python -m tests.rollout.transfer_trainer --address HOST:PORT --model DIR --out pushed.safetensors \\
        --mode all|head|inf|abandon|die-mid-send|tamper --seed 1 --run-id RUN [--device cuda]

It writes the weights it pushes to --out first (the test's reference), then prints one JSON line: {"version": the
service's version after the push} or {"code": the gRPC status, "details": ...}. Modes: all = every tensor
perturbed; head = only lm_head.weight changed; inf = `all` with an inf in one tensor; abandon = `all`, but the
process exits right after the first chunk (a trainer that dies mid-push); die-mid-send = `all`, but the process
exits half-way through the model's parameters, while the broadcast is in flight (with nccl the whole model is one
chunk: scripts/gpu_check.sh uses it with --device cuda). --device: where the model is (cuda: the nccl transfer).
tamper = `all`, played with an intruder on the weight channel: a store client (no secret) lists and reads the
rendezvous store during the push, and one element of TAMPER_TENSOR (in the first chunk) is altered between the
sender's digest and the socket, as a forged or altered packet would be; the report adds {"intruder": what the store
client saw, "health": after the push}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import grpc
import torch

INF_TENSOR = "model.layers.1.mlp.down_proj.weight"
TAMPER_TENSOR = "model.embed_tokens.weight"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["all", "head", "inf", "abandon", "die-mid-send", "tamper"], default="all")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--run-id", default="transfer-test")
    args = p.parse_args()

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from forkrl.remote.rollout import RolloutWeightSync
    from forkrl.training.rollouts import Rollouts

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if args.mode == "head" and name != "lm_head.weight":
                continue
            scale = 2.0 if args.mode == "head" else 1.0
            param.mul_(scale).add_(0.3 * param.std() * torch.randn(param.shape, generator=g))
        if args.mode == "inf":
            model.get_parameter(INF_TENSOR)[1, 2] = float("inf")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out)

    if args.mode == "abandon":  # the process dies right after its first chunk was received
        first = RolloutWeightSync.update_weights

        def update_then_die(self: RolloutWeightSync, update_info: dict) -> None:
            first(self, update_info)
            print(json.dumps({"abandoned_after": update_info["names"]}), flush=True)
            os._exit(3)

        RolloutWeightSync.update_weights = update_then_die  # type: ignore[method-assign]
    if args.mode == "die-mid-send":  # the process dies half-way through the broadcast
        import forkrl.training.rollouts as rollouts_mod

        source = rollouts_mod.lockstep_source
        half = len(list(model.parameters())) // 2

        def dying_source(module: torch.nn.Module, on_transfer: object) -> object:
            inner = source(module, on_transfer)

            class Dying(type(inner)):  # type: ignore[misc]
                def __iter__(self):  # noqa: ANN204
                    for i, item in enumerate(super().__iter__()):
                        if i == half:
                            print(json.dumps({"died_at_parameter": i}), flush=True)
                            os._exit(3)
                        yield item

            inner.__class__ = Dying
            return inner

        rollouts_mod.lockstep_source = dying_source  # type: ignore[assignment]
    model.to(args.device)

    intruder: dict = {}
    if args.mode == "tamper":
        intruder = tamper(model)
    rollouts = Rollouts([args.address], run_id=args.run_id)  # the token: FORKRL_TOKEN of the environment
    try:
        rollouts.push(model, 1, "transfer", Path(tempfile.gettempdir()))
        out = {"version": rollouts.clients[0].info().version, **rollouts.last_transfer}
        # the trainer trains on after a push: its parameters must still be plain leaves of autograd
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
        out["backward_warnings"] = [str(w.message)[:200] for w in caught]
        out["params_with_grad"] = sum(p.grad is not None for p in model.parameters())
    except grpc.RpcError as e:
        out = {"code": e.code().name, "details": e.details()}
    finally:
        if intruder:
            out |= {"intruder": {k: v for k, v in intruder.items() if k != "secret"},
                    "health": rollouts.clients[0].health()}
        rollouts.close()
    print(json.dumps(out), flush=True)
    return 0


def tamper(model: torch.nn.Module) -> dict:
    """The intruder of --mode tamper (see the module docstring); returns the dict it fills."""
    import datetime

    from torch.distributed import TCPStore

    from forkrl.remote.rollout import RolloutWeightSync
    from forkrl.weights import transfer_gloo

    seen: dict = {}
    target = model.get_parameter(TAMPER_TENSOR).data_ptr()
    forged: list[torch.Tensor] = []  # alive until the broadcast is through
    post, init, update = transfer_gloo._post, RolloutWeightSync.init_weight_transfer_engine, \
        RolloutWeightSync.update_weights

    def altered_post(group, tensor):  # noqa: ANN001, ANN202
        if tensor.data_ptr() == target:
            forged.append(tensor.clone())
            forged[-1].view(-1)[0] += 1.0
            seen["altered"] = TAMPER_TENSOR
            return post(group, forged[-1])
        return post(group, tensor)

    def spied_init(self, init_info):  # noqa: ANN001, ANN202
        seen["address"] = [init_info["master_address"], init_info["master_port"]]
        seen["secret"] = init_info.get("secret", "")  # the trainer's own, to search the store for
        return init(self, init_info)

    def spied_update(self, update_info):  # noqa: ANN001, ANN202
        if "keys" not in seen:  # during the push: a store client with no credentials
            store = TCPStore(seen["address"][0], seen["address"][1], is_master=False,
                             timeout=datetime.timedelta(seconds=10))
            keys = store.list_keys()
            values = [store.get(k).hex() for k in keys]
            seen["keys"] = keys
            secrets = [s for s in (seen["secret"], update_info.get("digest", "")) if s]
            seen["secret_in_store"] = any(s in x for s in secrets[:1] for x in [*keys, *values])
            seen["digest_in_store"] = any(s in x for s in secrets[1:] for x in [*keys, *values])
        return update(self, update_info)

    transfer_gloo._post = altered_post
    RolloutWeightSync.init_weight_transfer_engine = spied_init  # type: ignore[method-assign]
    RolloutWeightSync.update_weights = spied_update  # type: ignore[method-assign]
    return seen


if __name__ == "__main__":
    sys.exit(main())
