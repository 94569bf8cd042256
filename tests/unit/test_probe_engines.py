"""The probe's sampler choice and prompt encoding (no engine starts here; tests/probe/test_probe_vllm.py runs vLLM)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from forkrl.models.tiny import build_tokenizer
from forkrl.probe.engines import encode_prompts, resolve_sampler, vllm_importable
from forkrl.probe.params import ProbeParams

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


def test_auto_sampler_is_vllm_when_importable():
    assert resolve_sampler("auto") == ("vllm" if vllm_importable() else "transformers")
    assert [resolve_sampler(s) for s in ("vllm", "transformers", "rollout")] == ["vllm", "transformers", "rollout"]
    assert ProbeParams(model="m").sampler == "auto"


def test_rollout_sampler_needs_an_address_and_exactly_one_checkpoint():
    ok = ProbeParams(checkpoints=["a"], sampler="rollout", rollout_address="127.0.0.1:52600")
    assert ok.rollout_address == "127.0.0.1:52600"
    for kw in (
        dict(checkpoints=["a"], sampler="rollout"),  # no address
        dict(checkpoints=["a", "b"], sampler="rollout", rollout_address="h:1"),  # the service serves one model
        dict(model="m", checkpoints=["a"], sampler="rollout", rollout_address="h:1"),
        dict(checkpoints=["a"], rollout_address="h:1"),  # an address without the rollout sampler
    ):
        with pytest.raises(ValidationError):
            ProbeParams(**kw)


def test_chat_template_wraps_the_prompt_as_a_user_message():
    tok = build_tokenizer()
    plain = encode_prompts(tok, ["1+2=", "30+4="], chat_template=False)
    assert plain == [tok("1+2=")["input_ids"], tok("30+4=")["input_ids"]]
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(tok, ["1+2="], chat_template=True)
    tok.chat_template = TEMPLATE
    chat = encode_prompts(tok, ["1+2="], chat_template=True)
    assert tok.decode(chat[0]) == "<user>1+2=="  # the template's text, generation prompt "=" added, no BOS


def test_the_probe_takes_the_training_prompt_format_and_chat_template_is_its_older_name():
    assert ProbeParams(model="m").prompt_format == "raw"
    assert ProbeParams(model="m", chat_template=True).prompt_format == "chat"
    assert ProbeParams(model="m", prompt_format="dapo", system_prompt="Be exact.").prompt_format == "dapo"
    with pytest.raises(ValidationError, match="chat_template is prompt_format chat; it contradicts"):
        ProbeParams(model="m", chat_template=True, prompt_format="dapo_plain")
    with pytest.raises(ValidationError, match="system_prompt needs a chat format"):
        ProbeParams(model="m", system_prompt="Be exact.")
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    # the same ids as training's encoder (forkrl.data.prompts.PromptEncoder), for texts and problems alike
    from forkrl.data.prompts import PromptEncoder
    from forkrl.data.tasks import Problem

    assert encode_prompts(tok, ["1+2="], "chat") == PromptEncoder(tok, "chat").encode([Problem("1+2=", "")])
