"""A weight push applied in place while samples are generated (`--swap-mode inplace`, gRPC, the real vLLM
engine).

The push replaces only `lm_head.weight` of the embedded tiny model (untied): the keys and values of every
position are the same under both weights, so each served token's logprob must equal, to float32 rounding
(tests/numerics.py), the old model's teacher-forced logprob for the tokens sampled before the swap and the
new model's for those after it, with one switch point per sample. That is "the post-push tokens come from
the new weights", checked token by token, without assuming when the swap landed. Samples are drawn round
after round until the push has returned, so some are always in flight when it lands.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from forkrl.remote.rollout import RolloutClient
from forkrl.wire.rollout.v1 import rollout_pb2 as pb
from tests.numerics import float32_logprob_bound, reference_logprobs
from tests.service_fixtures import ServiceAddress, start_rollout_service, wait_until

pytestmark = pytest.mark.slow

PROMPT = "hello world"  # out of distribution: the tiny model runs long on it


@pytest.fixture(scope="module")
def service(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceAddress]:
    """Swap mode inplace: vLLM's scheduler paused in its "keep" mode, the reload, resume."""
    staging = tmp_path_factory.mktemp("staging-inplace")
    with start_rollout_service(tiny_model_dir, seed=0, kv_cache_gib=1, staging_dir=staging, swap_mode="inplace",
                               log_path=staging / "rollout.log") as address:
        yield address


def _models(model_dir: Path, state: dict[str, torch.Tensor] | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    out = []
    for dtype in (torch.float32, torch.float64):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        if state is not None:
            m.load_state_dict(state)
        out.append(m)
    return out[0], out[1]


def test_a_push_during_generation_keeps_the_samples_and_later_tokens_use_the_new_weights(
    service: ServiceAddress, tiny_model_dir: Path
) -> None:
    old32, old64 = _models(tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    new_state = {k: v.clone() for k, v in old32.state_dict().items()}
    head = new_state["lm_head.weight"]
    new_state["lm_head.weight"] = 2.0 * head + head.std() * torch.randn(head.shape, generator=g)
    new32, new64 = _models(tiny_model_dir, new_state)

    with RolloutClient(service, timeout_s=300) as client:
        client.wait_ready(120)
        info = client.info()
        v0, aborted = info.version, info.counters.aborted_requests
        n, max_new = 8, 240
        trajs: list[pb.Trajectory] = []
        stop = threading.Event()

        def sample(base: int) -> None:
            """Rounds of n samples, one after another, until after the push. Three of these run at once, so
            samples are in flight when the push lands even if it lands between two rounds of one of them."""
            k = 0
            while not stop.is_set():
                trajs.extend(client.generate([PROMPT], n=n, temperature=1.0, max_new_tokens=max_new,
                                             seed=base + k))
                k += 1

        samplers = [threading.Thread(target=sample, args=(1000 * (i + 1),)) for i in range(3)]
        for t in samplers:
            t.start()
        try:
            wait_until(lambda: client.info().counters.running_requests > 0
                       or not all(t.is_alive() for t in samplers), 300, "the samples to reach the engine")
            assert client.update_weights(new_state, v0 + 1) == v0 + 1
            assert client.last_weights_response.drain_s == 0.0
        finally:
            stop.set()
            for t in samplers:
                t.join(300)
        info = client.info()

    assert len(trajs) >= n and len(trajs) % n == 0 and info.counters.aborted_requests == aborted
    assert all(t.finish_reason != pb.FINISH_REASON_ABORT for t in trajs)
    assert {t.policy_version for t in trajs} <= {v0, v0 + 1} and v0 in {t.policy_version for t in trajs}
    assert all(t.last_policy_version >= t.policy_version for t in trajs)
    assert {t.last_policy_version for t in trajs} <= {v0, v0 + 1}

    seqs = [(list(t.prompt_token_ids), list(t.completion_token_ids)) for t in trajs]
    bound = max(float32_logprob_bound(seqs, old32, old64, 1.0), float32_logprob_bound(seqs, new32, new64, 1.0))
    mixed = 0
    for t, (prompt, completion) in zip(trajs, seqs, strict=True):
        served = torch.tensor(list(t.logprobs), dtype=torch.float64)
        is_old = (served - reference_logprobs(old64, prompt, completion, 1.0)[0]).abs() <= bound
        is_new = (served - reference_logprobs(new64, prompt, completion, 1.0)[0]).abs() <= bound
        k = int(is_old.logical_not().nonzero()[0]) if not bool(is_old.all()) else len(completion)
        # one switch: old weights up to k, the new weights from the first token the old ones cannot explain
        assert bool(is_old[:k].all()) and bool(is_new[k:].all()), (t.sample_index, k, is_old, is_new)
        if k < len(completion):
            assert t.last_policy_version == v0 + 1  # it reports the version its later tokens came from
        if t.policy_version == v0 + 1:
            assert bool(is_new.all())  # submitted after the push: every token from the new weights
        mixed += 0 < k < len(completion)
    assert mixed >= 1  # at least one sample was in flight across the push and continued under the new weights
    log_text = Path(service.log_path).read_text()
    assert f"weights v{v0 + 1} in place (in flight kept)" in log_text, log_text[-3000:]
