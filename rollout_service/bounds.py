"""The bounds of one Generate call, checked on the request before anything is tokenized or queued: prompts,
samples (prompts x n), tokens it may generate (samples x max_new_tokens) and the length of a text prompt.

    check_generate(request, settings)   # InvalidArgument naming the limit and the setting that raises it

The engine checks the values themselves (n > 0, temperature, max_model_len, ...); these caps only keep one
caller from asking for an unbounded amount of work.
"""

from __future__ import annotations

from typing import Any

from rollout_service.types import InvalidArgument


def _setting(name: str, value: int) -> str:
    return (
        f"the rollout service's {name} {value:,} (raise it with --{name.replace('_', '-')} or ROLLOUT_{name.upper()})"
    )


def check_generate(request: Any, settings: Any) -> None:
    """InvalidArgument when the GenerateRequest asks for more work than the settings allow."""
    prompts = len(request.prompts)
    if prompts > settings.max_prompts_per_request:
        raise InvalidArgument(
            f"{prompts:,} prompts exceed {_setting('max_prompts_per_request', settings.max_prompts_per_request)}"
        )
    n = max(int(request.sampling.n), 0)
    samples = prompts * n
    if samples > settings.max_samples_per_request:
        raise InvalidArgument(
            f"len(prompts) * sampling.n = {samples:,} exceeds "
            f"{_setting('max_samples_per_request', settings.max_samples_per_request)}"
        )
    tokens = samples * max(int(request.sampling.max_new_tokens), 0)
    if tokens > settings.max_request_tokens:
        raise InvalidArgument(
            f"len(prompts) * sampling.n * sampling.max_new_tokens = {tokens:,} exceeds "
            f"{_setting('max_request_tokens', settings.max_request_tokens)}"
        )
    for i, p in enumerate(request.prompts):
        if p.WhichOneof("input") == "text" and len(p.text) > settings.max_prompt_chars:
            raise InvalidArgument(
                f"prompts[{i}].text has {len(p.text):,} characters, more than "
                f"{_setting('max_prompt_chars', settings.max_prompt_chars)}"
            )
