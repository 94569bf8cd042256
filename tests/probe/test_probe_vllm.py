"""The probe's vLLM sampler (issue 14 item 3) on the tiny model, with a real in-process vLLM engine.

Samples from vLLM and from the transformers sampler come from different kernels, so they are never compared
token by token; what must hold is the shape of the result: prompt-major rows, responses cut after their first
EOS (kept), the same seed giving the same samples, and probe outputs with the same files, keys and grain,
whose record count is tokens probed x parameters x rows whichever sampler drew the responses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forkrl.probe.__main__ import main
from forkrl.probe.engines import encode_prompts, sample_with_vllm

pytestmark = pytest.mark.slow

PROMPTS = ["1+2+3=", "12+3+45=", "7+8=", "100+1+2+3="]  # four token lengths: one vLLM call batches them all


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_vllm_samples_are_well_formed_and_seeded(tiny_model_dir, tok):
    ids = encode_prompts(tok, PROMPTS, chat_template=False)
    eos = tok.eos_token_id
    kw = dict(group_size=3, temperature=1.0, max_new_tokens=16, eos_ids=[eos])
    trajs = sample_with_vllm(tiny_model_dir, ids, seed=5, **kw)
    assert [(t.index, t.prompt_index) for t in trajs] == [(i * 3 + g, i) for i in range(4) for g in range(3)]
    for t in trajs:
        assert t.prompt_ids == ids[t.prompt_index] == tok(PROMPTS[t.prompt_index])["input_ids"]
        assert 1 <= t.n_response <= 16 and all(0 <= x < len(tok) for x in t.response_ids)
        assert eos not in t.response_ids[:-1]  # cut after the first EOS
        assert t.finished == (t.response_ids[-1] == eos)
        assert t.finished or t.n_response == 16
    assert sum(t.finished for t in trajs) >= len(trajs) // 2  # the trained tiny model ends its answers
    again = sample_with_vllm(tiny_model_dir, ids, seed=5, **kw)
    assert [t.response_ids for t in again] == [t.response_ids for t in trajs]  # one seed per sample

    # ignore_eos (the benchmark's mode): every response runs to max_new_tokens; past the model's positions
    # (256) vLLM cuts the response, and says so
    notes: list[str] = []
    long = sample_with_vllm(tiny_model_dir, ids[:1], seed=0, ignore_eos=True, notes=notes,
                            **{**kw, "group_size": 1, "max_new_tokens": 300})  # fmt: skip
    assert long[0].n_response == 256 - len(ids[0]) and not long[0].finished
    assert len(notes) == 1 and "max_position_embeddings" in notes[0]


def test_engines_in_worker_threads_take_turns_and_leave_torch_as_they_found_it(tiny_model_dir, tok):
    """What the probe service's job workers do: two jobs sample with vLLM at once, each in its own thread. A second
    in-process engine built while one lives fails (vLLM's model-parallel groups are process-global), so they
    take turns (engines.py's lock); each gives what it gives alone. vLLM's CPU worker replaces
    torch.set_num_threads with a no-op process-wide: afterwards torch's own function and the thread count are
    back, and no engine is left alive (its weights and KV cache are freed with it)."""
    import gc
    import threading

    import torch
    from vllm import LLM

    ids = encode_prompts(tok, PROMPTS[:2], chat_template=False)
    kw = dict(group_size=2, temperature=1.0, max_new_tokens=8, seed=3, eos_ids=[tok.eos_token_id])
    set_num_threads, n_threads = torch.set_num_threads, torch.get_num_threads()
    got: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def job(k: int) -> None:
        try:
            got[k] = [t.response_ids for t in sample_with_vllm(tiny_model_dir, ids, **kw)]
        except BaseException as e:  # reported below, with the other thread's
            errors.append(e)

    workers = [threading.Thread(target=job, args=(k,), name=f"probe-job-{k}") for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    assert got[0] == got[1] and len(got[0]) == 4
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == n_threads
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, LLM)]


def _run(ckpt_root: Path, out: Path, sampler: str) -> tuple[dict, list[dict], dict]:
    argv = ["--checkpoint-root", str(ckpt_root), "--steps", "1", "--num-prompts", "6", "--num-samples", "2",
            "--max-new-tokens", "24", "--entropy-bins", "3", "--max-positions-per-group", "4",
            "--layer-indices", "0,-1", "--row-spec", "start,mid,last", "--bootstrap", "10", "--sampler", sampler,
            "--output-dir", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "token_probe_records.jsonl").read_text().splitlines()]
    return summary, records, json.loads((out / "manifest.json").read_text())


def test_probe_outputs_from_vllm_have_the_same_keys_and_grain(tiny_model_dir, tmp_path: Path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step_000001").symlink_to(Path(tiny_model_dir).resolve(), target_is_directory=True)
    runs = {s: _run(root, tmp_path / s, s) for s in ("vllm", "transformers")}
    (sv, rv, mv), (st, rt, mt) = runs["vllm"], runs["transformers"]
    assert sv["settings"]["sampler"] == "vllm" and st["settings"]["sampler"] == "transformers"
    assert mv["checkpoints"][0]["sampler"] == "vllm" and mv["params"]["sampler"] == "vllm"
    assert set(sv) == set(st) and set(mv) == set(mt)
    assert set(sv["checkpoints"][0]) == set(st["checkpoints"][0])
    assert {frozenset(r) for r in sv["results"]} == {frozenset(r) for r in st["results"]}
    assert rv and {frozenset(r) for r in rv} == {frozenset(r) for r in rt}
    for summary, records, manifest in runs.values():
        info = summary["checkpoints"][0]
        assert info["n_trajectories"] == 12 and info["n_response_tokens"] > 0
        n_params = len(manifest["checkpoints"][0]["targets"])
        assert len(records) == summary["n_records"] == info["n_selected"] * n_params * 3  # tokens x params x rows
        keys = {(r["checkpoint"], r["bin"], r["correct"], r["parameter"], r["row"]) for r in summary["results"]}
        assert len(keys) == len(summary["results"])  # one result per checkpoint x bin x correct x param x row
        # the entropy pass scores the sampled tokens teacher-forced: logp is that of the records' own tokens
        assert manifest["checkpoints"][0]["max_abs_logp_gap_entropy_vs_grad_pass"] < 1e-4


def test_rollout_sampler_through_a_running_service(tiny_model_dir, tok, tmp_path: Path):
    """sampler rollout: the probe's one checkpoint is the model the service serves; rows come back
    prompt-major and EOS-trimmed like the in-process paths, and the job's outputs have the same grain."""
    from forkrl.probe.engines import sample_with_rollout
    from tests.service_fixtures import start_rollout_service

    ids = encode_prompts(tok, PROMPTS, chat_template=False)
    eos = tok.eos_token_id
    with start_rollout_service(tiny_model_dir, kv_cache_gib=1, seed=0) as address:
        trajs = sample_with_rollout(str(address), ids, group_size=2, temperature=1.0, max_new_tokens=16, seed=3,
                                    eos_ids=[eos])  # fmt: skip
        out = tmp_path / "out"
        argv = ["--checkpoints", str(tiny_model_dir), "--num-prompts", "4", "--num-samples", "2",
                "--max-new-tokens", "16", "--entropy-bins", "2", "--max-positions-per-group", "3",
                "--bootstrap", "0", "--sampler", "rollout", "--rollout-address", str(address),
                "--output-dir", str(out), "--no-progress"]  # fmt: skip
        assert main(argv) == 0
    assert [(t.index, t.prompt_index) for t in trajs] == [(i * 2 + g, i) for i in range(4) for g in range(2)]
    for t in trajs:
        assert t.prompt_ids == ids[t.prompt_index] and 1 <= t.n_response <= 16
        assert eos not in t.response_ids[:-1] and t.finished == (t.response_ids[-1] == eos)
    summary = json.loads((out / "summary.json").read_text())
    n_records = len((out / "token_probe_records.jsonl").read_text().splitlines())
    n_params = len(json.loads((out / "manifest.json").read_text())["checkpoints"][0]["targets"])
    assert summary["settings"]["sampler"] == "rollout" and summary["checkpoints"][0]["n_trajectories"] == 8
    assert n_records == summary["n_records"] == summary["checkpoints"][0]["n_selected"] * n_params * 3
