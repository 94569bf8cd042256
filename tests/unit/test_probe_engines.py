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
