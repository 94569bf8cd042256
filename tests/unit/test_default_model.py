"""The committed embedded default (forkrl/models/default): its files match SHA256SUMS, its build record matches
the builder's config, every default points at it, and `install` copies it byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from forkrl.files import sha256_file
from forkrl.models.embedded import COMMITTED_DIR, MANIFEST, install_default, manifest_entries, manifest_problems
from forkrl.models.tiny import (
    BUILD_RECORD,
    MODEL_FILE,
    REQUIRED_FILES,
    BuildConfig,
    default_model_dir,
    read_build_record,
)

ROOT = Path(__file__).resolve().parents[2]


def test_committed_files_match_the_manifest():
    assert manifest_problems(COMMITTED_DIR) == []
    assert set(manifest_entries(COMMITTED_DIR)) == {*REQUIRED_FILES, BUILD_RECORD}


def test_build_record_matches_the_model_and_the_builder_config():
    record = read_build_record(COMMITTED_DIR)
    assert record is not None, "the committed default is not a complete build"
    assert record["sha256"] == manifest_entries(COMMITTED_DIR)[MODEL_FILE] == sha256_file(COMMITTED_DIR / MODEL_FILE)
    # a builder change that alters what a build produces must re-bless the committed default (embedded.py)
    assert record["config_hash"] == BuildConfig().hash(record["seed"])
    assert record["reached_target"] and 0.20 <= record["accuracy"]["t1"] <= 0.50


def test_its_doc_states_the_committed_numbers():
    record = read_build_record(COMMITTED_DIR)
    readme = (ROOT / "docs" / "embedded-default.md").read_text()
    assert record["sha256"] in readme
    assert f"{record['params']:,}" in readme and f"{record['sft_steps']} SFT steps" in readme
    acc = record["accuracy"]
    assert f"T=1 {acc['t1']:.3f}" in readme and f"greedy {acc['greedy']:.3f}" in readme


def test_the_default_is_the_committed_copy_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.delenv("FORKRL_MODEL_DIR", raising=False)
    assert default_model_dir() == COMMITTED_DIR == ROOT / "forkrl" / "models" / "default"
    monkeypatch.setenv("FORKRL_MODEL_DIR", str(tmp_path / "m"))
    assert default_model_dir() == tmp_path / "m"


def test_it_ships_with_the_package():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '[tool.setuptools.package-data]\n' in pyproject and '"forkrl.models" = ["default/*"]' in pyproject
    assert "/models/" in (ROOT / ".gitignore").read_text().splitlines()  # only the repo-root models/ is ignored


def test_install_copies_verifies_and_reuses(tmp_path):
    out = install_default(tmp_path / "m")
    assert manifest_problems(out) == [] and manifest_entries(out) == manifest_entries(COMMITTED_DIR)
    assert read_build_record(out)["sha256"] == read_build_record(COMMITTED_DIR)["sha256"]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert install_default(out) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # same bytes: nothing rewritten
    # a stale build (another machine's bytes, no manifest) is replaced
    (out / MANIFEST).unlink()
    (out / MODEL_FILE).write_bytes(b"other")
    install_default(out)
    assert manifest_problems(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary directory left


def test_install_refuses_what_it_did_not_build(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="not a forkrl tiny build"):
        install_default(tmp_path / "m")
    broken = tmp_path / "src"
    install_default(broken)
    (broken / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json: sha256"):
        install_default(tmp_path / "o", source=broken)


def test_install_through_a_link_to_the_source_is_a_no_op_and_never_writes_through_one(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(COMMITTED_DIR)
    assert install_default(link) == link
    other = install_default(tmp_path / "other")
    (other / MANIFEST).unlink()
    (other / MODEL_FILE).write_bytes(b"other")
    link2 = tmp_path / "link2"
    link2.symlink_to(other)
    with pytest.raises(ValueError, match="symbolic link"):
        install_default(link2)
    assert (other / MODEL_FILE).read_bytes() == b"other"
