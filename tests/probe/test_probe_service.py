"""The probe service end to end: a real uvicorn server on 127.0.0.1, real jobs on two checkpoints over HTTP.

Checkpoints: the tiny model copied as step_000001 and a perturbed copy as step_000002 in a tmp
checkpoint_root inside the service's only allowed root. The server runs with one worker and no queue, so a
second job while one is active gets 429. The server listens on a socket bound before it starts (no port
race); job counts and metrics are compared before/after inside each test, so any order works.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from markupsafe import escape
from safetensors.torch import load_file, save_file

from forkrl.remote.channel import http_headers
from probe_service.app import create_app
from probe_service.config import ProbeSettings
from tests.service_fixtures import build_random_llama, wait_until

pytestmark = pytest.mark.slow

SMALL_JOB = {
    "sampler": "transformers",  # the service plumbing; vLLM sampling is tested in test_probe_vllm.py
    "steps": [1, 2],
    "num_prompts": 4,
    "group_size": 4,
    "entropy_bins": 3,
    "max_positions_per_group": 4,
    "max_positions_per_trajectory": 2,
    "modules": ["k_proj", "down_proj", "lm_head"],
    "layers": [0, -1],
    "row_specs": ["random:8", "start"],
    "proj_k": [1, 2],
    "erank_draws": 3,
    "seed": 7,
    "record_grain": "token",  # one record per token with all 10 grad norms (row grain: test_probe_cli.py)
    "row_mode": "block",
    "bootstrap": 20,
}


def _model_dir(request: pytest.FixtureRequest, tmp: Path) -> Path:
    try:
        return Path(request.getfixturevalue("tiny_model_dir"))
    except pytest.FixtureLookupError:  # no embedded tiny model in this checkout: a random one will do
        return build_random_llama(tmp / "random_tiny", hidden_size=32, num_layers=2)


@pytest.fixture(scope="module")
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("probe_service")
    allowed = tmp / "allowed"
    root = allowed / "run" / "checkpoints"
    root.mkdir(parents=True)
    src = _model_dir(request, tmp)
    ignore = shutil.ignore_patterns("*.bin", "*.pt", "forkrl_build.json")
    shutil.copytree(src, root / "step_000001", ignore=ignore)
    shutil.copytree(src, root / "step_000002", ignore=ignore)
    weights = root / "step_000002" / "model.safetensors"
    tensors = load_file(weights)
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            k: v + 0.05 * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=g, dtype=v.dtype)
            if v.is_floating_point() and v.numel() > 1
            else v
            for k, v in tensors.items()
        },
        str(weights),
        metadata={"format": "pt"},
    )
    broken = allowed / "broken"  # passes the submission checks, fails when the job loads it
    shutil.copytree(root / "step_000001", broken)
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    pickled = allowed / "pickled"  # weights only as a pickle: must be refused, never unpickled
    pickled.mkdir()
    shutil.copy(root / "step_000001" / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not really a pickle")
    outside = tmp / "outside"
    shutil.copytree(root / "step_000001", outside / "step_000009")
    (allowed / "escape").symlink_to(outside, target_is_directory=True)
    (root / "step_000003").symlink_to(outside / "step_000009", target_is_directory=True)

    settings = ProbeSettings(
        allowed_roots=[str(allowed)],
        jobs_dir=str(tmp / "jobs"),
        max_concurrent_jobs=1,
        max_queued_jobs=0,
        threads=1,
        device="cpu",
        log_level="warning",
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound here and handed to uvicorn: nobody can take the port in between
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, "the probe server to start")
        assert server.started, "the probe server exited at start-up"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300, headers=http_headers()) as client:
            yield {"client": client, "root": root, "allowed": allowed, "outside": outside, "jobs": tmp / "jobs",
                   "tmp": tmp}
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _strict(text: str):
    def bad(c: str):
        raise AssertionError(f"non-finite {c} in JSON")

    return json.loads(text, parse_constant=bad)


def _poll(client: httpx.Client, url: str, states: set[str], timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.get(url).json()
        if st["state"] in states:
            return st
        assert time.monotonic() < deadline, f"job stuck in {st['state']}: {st}"
        time.sleep(0.1)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _metrics(client: httpx.Client) -> dict[str, float]:
    """The /metrics samples as {'name{label="v"}': value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_job_end_to_end_and_wait(env):
    client, root = env["client"], env["root"]
    t0 = time.monotonic()
    r = client.post("/probe", json={"checkpoint_root": str(root), **SMALL_JOB})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert r.headers["location"].endswith(f"/probe/{job_id}")
    st = _poll(client, r.headers["location"], {"done", "failed", "cancelled"})
    assert st["state"] == "done", st["error"]
    assert st["progress"]["done"] == st["progress"]["total"] > 0
    assert st["timings"]["run_s"] > 0
    summary = st["summary"]

    out = env["jobs"] / job_id
    for name in (
        "summary.json",
        "token_probe_records.jsonl",
        "manifest.json",
        "job.json",
        "plot_step_000001.png",
        "plot_step_000002.png",
    ):
        assert (out / name).is_file(), name
    assert _strict((out / "summary.json").read_text()) == summary
    assert "teacher forcing" in summary["caveat"] and summary["bins"]["frozen_from"] == "step_000001"
    assert summary["checkpoints"][1]["bin_edges"] == summary["checkpoints"][0]["bin_edges"]  # frozen
    overlap = summary["entropy_pattern_overlap"]["overlap"]
    assert overlap["step_000001"] == 1.0 and 0.0 <= overlap["step_000002"] <= 1.0
    records = [_strict(line) for line in (out / "token_probe_records.jsonl").read_text().splitlines()]

    # counts: records == selected positions == per-cell counts == per-result counts
    assert [c["label"] for c in summary["checkpoints"]] == ["step_000001", "step_000002"]
    assert len(records) == summary["n_records"] == sum(c["n_selected"] for c in summary["checkpoints"]) > 0
    per_cell = Counter((x["checkpoint"], x["bin"], x["correct"]) for x in records)
    for c in summary["checkpoints"]:
        assert c["step"] in (1, 2)
        for cell in c["cells"]:
            assert per_cell[(c["label"], cell["bin"], cell["correct"])] == cell["n_selected"]
            assert cell["n_selected"] <= min(4, cell["n_available"])
    targets = {x["target"] for x in summary["results"]}
    assert len(targets) == 5  # k_proj and down_proj of 2 layers + lm_head
    for res in summary["results"]:
        assert res["n_selected"] == per_cell[(res["checkpoint"], res["bin"], res["correct"])]
        assert res["n"] + res["n_dropped"] == res["n_selected"]
        if res["n"] >= 1:
            assert res["grad_norm"]["median"] > 0 and math.isfinite(res["effective_rank"])
    per_traj = Counter((x["checkpoint"], x["bin"], x["correct"], x["trajectory"]) for x in records)
    assert max(per_traj.values()) <= 2
    for x in records:
        assert len(x["grad_norms"]) == 10 and all(math.isfinite(v) for v in x["grad_norms"].values())
        assert x["entropy"] >= 0 and x["logp"] <= 0

    manifest = client.get(f"/probe/{job_id}/manifest").json()
    shas = {c["label"]: c["weight_files"][0]["sha256"] for c in manifest["checkpoints"]}
    assert shas["step_000001"] == _sha(root / "step_000001" / "model.safetensors")
    assert shas["step_000002"] == _sha(root / "step_000002" / "model.safetensors") != shas["step_000001"]
    assert manifest["params"]["seed"] == 7 and manifest["versions"]["torch"] == torch.__version__
    assert client.get(f"/probe/{job_id}/records", params={"format": "json"}).json() == records
    jsonl = client.get(f"/probe/{job_id}/records")
    assert jsonl.headers["content-type"].startswith("application/x-ndjson")
    assert [_strict(line) for line in jsonl.text.splitlines()] == records
    png = client.get(f"/probe/{job_id}/plot.png", params={"checkpoint": "step_000002"})
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
    png = client.get(f"/probe/{job_id}/overlap.png")
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
    # the job's report: one self-contained page, the same as the core renders from the job's files
    from forkrl.report.probe_page import render_probe_report

    page = client.get(f"/probe/{job_id}/report")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.text == render_probe_report(out) and str(escape(summary["caveat"])) in page.text
    assert st["links"]["report"].endswith(f"/probe/{job_id}/report")
    assert client.get("/probe/no-such-job/report").status_code == 404
    missing_plot = client.get(f"/probe/{job_id}/plot.png", params={"checkpoint": "step_000005"})
    assert missing_plot.status_code == 404 and "step_000001" in missing_plot.json()["detail"]
    assert client.delete(f"/probe/{job_id}").status_code == 409  # already finished

    # the same request with ?wait=true: the same summary (same seed), straight away as 200
    r2 = client.post("/probe", params={"wait": "true"}, json={"checkpoint_root": str(root), **SMALL_JOB})
    assert r2.status_code == 200, r2.text
    assert _strict(r2.text) == summary
    print(f"\nservice end-to-end: two jobs x two checkpoints in {time.monotonic() - t0:.1f} s")


def test_paths_are_confined_to_allowed_roots(env):
    client, root, allowed = env["client"], env["root"], env["allowed"]
    cases = [
        ({"checkpoint_root": f"{root}/../../../outside", "steps": [9]}, {400, 403}),  # '..' escape
        ({"checkpoint_root": str(allowed / "escape"), "steps": [9]}, {403}),  # symlinked dir out
        ({"checkpoint_root": str(root), "steps": [3]}, {403}),  # step dir is a symlink out
        ({"checkpoints": [str(env["outside"] / "step_000009")]}, {403}),  # plainly outside
        ({"checkpoints": ["/etc"]}, {403}),
        ({"model": str(allowed / "escape" / "step_000009")}, {403}),
        ({"checkpoints": [str(allowed / "nope")]}, {404}),
    ]
    for body, codes in cases:
        r = client.post("/probe", json=body)
        assert r.status_code in codes, (body, r.status_code, r.text)
        assert isinstance(r.json()["detail"], str) and r.json()["detail"]


def test_openapi_documents_every_request_field(env):
    schema = env["client"].get("/openapi.json").json()["components"]["schemas"]["ProbeParams"]["properties"]
    assert {
        "checkpoint_root",
        "steps",
        "include_final",
        "checkpoints",
        "model",
        "num_prompts",
        "num_samples",
        "temperature",
        "max_new_tokens",
        "seed",
        "entropy_bins",
        "max_positions_per_group",
    } <= set(schema)
    assert all(p.get("description") for p in schema.values())
    assert schema["num_prompts"]["minimum"] == 1 and schema["num_prompts"]["default"] == 24
    # the seed's names are the documented ones; the older names are accepted (SMALL_JOB uses them)
    assert {"num_samples", "layer_indices", "row_spec", "row_mode", "record_grain", "freeze_bins_from"} <= set(schema)
    assert "caveat" in env["client"].get("/openapi.json").json()["info"]["description"].lower()


def test_missing_steps_404_lists_existing(env):
    r = env["client"].post("/probe", json={"checkpoint_root": str(env["root"]), "steps": [1, 40]})
    assert r.status_code == 404
    body = r.json()
    assert body["missing_steps"] == [40] and body["available_steps"] == [1, 2, 3]
    assert "[40]" in body["detail"] and "[1, 2, 3]" in body["detail"]
    r = env["client"].post("/probe", json={"checkpoint_root": str(env["root"]), "include_final": True})
    assert r.status_code == 404 and "final" in r.json()["detail"]


def test_only_json_bodies_413_415_and_host(env):
    """A browser posts forms cross-site without asking (urlencoded, multipart, text/plain): only
    application/json is read (415 otherwise, before the body is parsed); bodies are bounded (413); a Host this
    service does not answer to gets 400 (DNS rebinding); /healthz stays open to any Host."""
    body = json.dumps({"checkpoint_root": str(env["root"]), "steps": [1, 40]})
    client = env["client"]
    for ctype in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/plain", None):
        headers = {"content-type": ctype} if ctype else {}
        r = client.post("/probe", content=body, headers=headers)
        assert r.status_code == 415, (ctype, r.status_code, r.text)
        assert "application/json" in r.json()["detail"]
    r = client.post("/probe", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 404 and r.json()["missing_steps"] == [40]
    for method, path in (("PUT", "/metrics"), ("PUT", "/probe/x"), ("PATCH", "/probe/x/records")):
        r = client.request(method, path, content=body, headers={"content-type": "text/plain"})
        assert r.status_code == 405 and "415" not in r.text, (method, path, r.text)  # the method before the body
    big = json.dumps({"checkpoint_root": "x" * (1 << 20), "steps": [1]})
    r = client.post("/probe", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["detail"]

    def chunks():  # no content-length: counted while it is read
        yield big.encode()

    r = client.post("/probe", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    for host in ("evil.example", "evil.example:8000", "127.0.0.2"):
        r = client.get("/probe", headers={"host": host})
        assert r.status_code == 400 and "--allowed-hosts" in r.json()["detail"], (host, r.text)
        assert client.get("/healthz", headers={"host": host}).status_code == 200
    for host in ("localhost", "127.0.0.1:1234", "[::1]:80"):
        assert client.get("/probe", headers={"host": host}).status_code == 200, host


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_prompts", 0),
        ("group_size", 100_000),
        ("temperature", -1.0),
        ("entropy_bins", 0),
        ("max_positions_per_group", 0),
        ("modules", ["conv"]),
        ("row_specs", ["first"]),
        ("dtype", "int8"),
        ("split", "test"),
        ("grad_chunk_size", 1000),
        ("steps", [-1]),
        ("bogus_field", 1),
    ],
)
def test_bad_parameters_422_name_the_field(env, field, value):
    r = env["client"].post("/probe", json={"checkpoint_root": str(env["root"]), "steps": [1], field: value})
    assert r.status_code == 422, r.text
    assert any(field in err["loc"] for err in r.json()["detail"]), r.json()


def test_semantic_errors_400(env):
    base = {"checkpoint_root": str(env["root"]), "steps": [1]}
    r = env["client"].post("/probe", json={**base, "task": "nope"})
    assert r.status_code == 400 and "nope" in r.json()["detail"]
    r = env["client"].post("/probe", json={**base, "reward": "os:system"})
    assert r.status_code == 400 and "not allowed" in r.json()["detail"]
    r = env["client"].post("/probe", json={"checkpoints": [str(env["allowed"] / "pickled")]})
    assert r.status_code == 400 and "safetensors" in r.json()["detail"]
    r = env["client"].post("/probe", json={**base, "layers": [0, 7], "clamp_layers": False})
    assert r.status_code == 400 and "[7]" in r.json()["detail"]
    r = env["client"].post("/probe", json={"steps": [1]})  # steps without a root: schema-level
    assert r.status_code == 422


def test_failed_job_reports_its_error(env):
    client = env["client"]
    r = client.post("/probe", params={"wait": "true"}, json={"checkpoints": [str(env["allowed"] / "broken")]})
    assert r.status_code == 500 and "no_such_architecture" in r.json()["detail"]
    st = client.get(f"/probe/{r.json()['id']}").json()
    assert st["state"] == "failed" and "no_such_architecture" in st["error"] and st["summary"] is None
    assert client.get(f"/probe/{st['id']}/manifest").status_code == 409
    assert client.get(f"/probe/{st['id']}/report").status_code == 409


def test_queue_limit_429_and_cancel(env):
    client, root = env["client"], env["root"]
    before = _metrics(client)
    big = {**SMALL_JOB, "steps": [1], "num_prompts": 512, "group_size": 16, "max_positions_per_group": 64}
    r = client.post("/probe", json={"checkpoint_root": str(root), **big})
    assert r.status_code == 202
    url = r.headers["location"]
    job_id = r.json()["id"]
    try:
        _poll(client, url, {"running"}, timeout_s=30)
        r2 = client.post("/probe", json={"checkpoint_root": str(root), **SMALL_JOB})
        assert r2.status_code == 429 and "limit" in r2.json()["detail"]
    finally:
        d = client.delete(f"/probe/{job_id}")
    assert d.status_code in (200, 202) and d.json()["cancel_requested"]
    # a running job stops at its next check: within the poll's deadline, not after its hour of work
    st = _poll(client, url, {"cancelled", "done", "failed"}, timeout_s=120)
    assert st["state"] == "cancelled"
    assert client.get(f"/probe/{job_id}/records").status_code == 409
    assert client.delete(f"/probe/{job_id}").status_code == 409
    assert client.get("/probe/0000").status_code == 404
    # the slot is free again
    health = client.get("/healthz").json()
    assert health["status"] == "ok" and health["jobs"].get("running", 0) == 0
    after = _metrics(client)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert delta['probe_jobs{state="cancelled"}'] == 1 and delta["probe_jobs_rejected_total"] == 1
    assert delta["probe_jobs_submitted_total"] == 1
    assert delta['probe_jobs{state="done"}'] == delta['probe_jobs{state="failed"}'] == 0
    assert delta['probe_jobs{state="running"}'] == delta['probe_jobs{state="queued"}'] == 0
    assert delta['probe_job_seconds_count{state="cancelled"}'] == 1 and "probe_records_total" in after


def test_dataset_path_and_symlinks_inside_a_checkpoint(env):
    """A job's dataset must lie inside the allowed roots, like its checkpoints; a checkpoint may hold a
    symlinked file when the link's target is inside the roots too, never one that points out of them."""
    client, root, allowed, tmp = env["client"], env["root"], env["allowed"], env["tmp"]
    data = allowed / "data" / "one_digit.jsonl"  # every prompt is BOS + 'a+b+c=': 7 tokens
    data.parent.mkdir(exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}+{c}=", "answer": str(a + b + c)}) + "\n"
                            for a in range(10) for b in range(10) for c in range(10)))
    (tmp / "outside_data.jsonl").write_text(data.read_text())

    def linked_checkpoint(name: str, target: Path) -> Path:
        d = allowed / name
        d.mkdir(exist_ok=True)
        for f in (root / "step_000001").iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, d / f.name)
        (d / "model.safetensors").unlink(missing_ok=True)
        (d / "model.safetensors").symlink_to(target)
        return d

    inside = linked_checkpoint("linked_inside", root / "step_000001" / "model.safetensors")
    leaky = linked_checkpoint("linked_outside", env["outside"] / "step_000009" / "model.safetensors")
    job = {**SMALL_JOB, "steps": [], "num_prompts": 4, "max_new_tokens": 12, "modules": ["lm_head"],
           "layers": [-1], "row_specs": ["start"], "proj_k": [1]}
    for body, code, needle in (
        ({"checkpoints": [str(leaky)], "dataset": str(data)}, 403, "links outside the allowed roots"),
        ({"checkpoints": [str(inside)], "dataset": str(tmp / "outside_data.jsonl")}, 403, "outside the allowed"),
        ({"checkpoints": [str(inside)], "dataset": str(allowed / "data" / "nope.jsonl")}, 404, "does not exist"),
        ({"checkpoints": [str(inside)], "dataset": f"{allowed}/data/../data/one_digit.jsonl"}, 400, ".."),
    ):
        r = client.post("/probe", json={**job, **body})
        assert r.status_code == code and needle in r.json()["detail"], (body, r.status_code, r.text)

    r = client.post("/probe", params={"wait": "true"}, json={**job, "checkpoints": [str(inside)], "dataset": str(data)})
    assert r.status_code == 200, r.text
    summary = _strict(r.text)
    assert summary["settings"]["dataset"] == str(data) and summary["n_records"] > 0
    manifest = client.get(f"{r.headers['location']}/manifest").json()
    assert manifest["resolved"]["reward"] == "math_verify"  # a dataset's default reward
    # the weights read were the link's target
    assert manifest["checkpoints"][0]["weight_files"][0]["sha256"] == _sha(root / "step_000001" / "model.safetensors")
    records = client.get(f"{r.headers['location']}/records", params={"format": "json"}).json()
    assert records and all(x["position"] - x["response_position"] == 7 for x in records)  # the dataset's prompts
