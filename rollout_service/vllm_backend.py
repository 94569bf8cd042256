"""The vLLM adapter: the only code in the rollout service that touches vLLM (`AsyncLLM`).

One engine request per sample (FINAL_ONLY outputs, the sampled token's logprob at the request's
temperature), abort, in-place reload through the worker extension (`worker_ext.py`), prefix-cache reset.

Reload with requests in flight (`keep_running=True`, swap mode "inplace"): the engine core's scheduler is paused
in vLLM's "keep" mode (it finishes the step it is in, then skips steps with every request kept scheduled, KV
cache included), the weights are reloaded through `collective_rpc` and the scheduler resumes: generation stalls
for those three engine-core calls (bench/bench_swap.py measures it in engine steps).
The prefix cache cannot be reset while requests hold KV blocks, so every request carries `cache_salt` = the
weights' epoch (bumped by each reload): a later request never matches a block computed by replaced weights.
vLLM is imported inside the methods, so the rest of the service (and its plumbing tests) imports without it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from rollout_service.types import Completion, InvalidArgument, SamplingSpec

log = logging.getLogger("rollout_service")


class VllmBackend:
    """AsyncLLM with one request per sample, FINAL_ONLY outputs and sampled-token logprobs at T.

    Built with `await VllmBackend.start(settings)`; the engine is constructed in a worker thread so the
    gRPC server keeps answering health checks (NOT_SERVING) during the ~10-20 s start."""

    def __init__(self, llm: Any, settings: Any, engine_settings: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._llm = llm
        self._epoch = 0  # reloads so far: the prefix-cache salt of new requests
        self.last_reload_s = 0.0  # the slowest worker's own time for the last reload (bench_swap's breakdown)
        self._SamplingParams = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.model = settings.model
        tok = llm.get_tokenizer()
        self._tokenizer = tok
        hf_config = llm.model_config.hf_config
        self.vocab_size = len(tok)
        self.vocab_limit = max(len(tok), int(getattr(hf_config, "vocab_size", 0) or 0))
        eos = getattr(tok, "eos_token_id", None)
        self.eos_token_id = int(eos) if eos is not None else -1
        self.max_model_len = int(llm.model_config.max_model_len)
        self.engine_settings = engine_settings | {
            "max_model_len": self.max_model_len,
            "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        }

    @classmethod
    async def start(cls, settings: Any) -> VllmBackend:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=settings.model,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            enforce_eager=settings.enforce_eager,
            seed=settings.seed,
            max_num_seqs=settings.max_num_seqs,
            kv_cache_memory_bytes=int(settings.kv_cache_gib * (1 << 30)),
            # log_softmax(logits / T) of the sampled token: the quantity the trainer's ratio needs.
            logprobs_mode="processed_logprobs",
            worker_extension_cls="rollout_service.worker_ext.WeightReloadExtension",
            disable_log_stats=True,
            # vLLM 0.32 CPU bug: a partially prefilled *seeded* request makes the model runner rewind its
            # sampling generator with set_offset(), which CPU generators do not have -> the engine core
            # dies ("CPU Generator does not use offset"). Without chunked prefill every prompt is
            # prefilled in one step (max_num_batched_tokens >= max_model_len), so nothing is rewound.
            enable_chunked_prefill=False if current_platform.is_cpu() else None,
            # No hub at run time: the model is a local directory.
            trust_remote_code=False,
        )
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        engine_settings = {
            "dtype": settings.dtype,
            "enforce_eager": settings.enforce_eager,
            "logprobs_mode": "processed_logprobs",
            "kv_cache_gib": settings.kv_cache_gib,
            "device": llm.vllm_config.device_config.device_type,
            "vllm_version": vllm.__version__,
            "engine_mode": settings.engine_mode,
        }
        backend = cls(llm, settings, engine_settings)
        del llm  # the backend owns the engine; see shutdown()
        return backend

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=True: what vLLM itself does for a text prompt (BOS for tokenizers that add it)
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    async def generate_one(
        self, request_id: str, prompt_ids: list[int], spec: SamplingSpec, seed: int | None
    ) -> Completion:
        try:
            params = self._sampling_params(spec, seed)
        except ValueError as e:  # vLLM's own checks (VLLMValidationError): a bad request, not a bug
            raise InvalidArgument(f"sampling: {e}") from None
        final = None
        prompt = {"type": "token", "prompt_token_ids": prompt_ids,  # vllm.inputs.engine.TokensInput
                  "cache_salt": f"w{self._epoch}"}
        async for out in self._llm.generate(prompt, params, request_id=request_id):
            final = out
        assert final is not None and final.finished
        c = final.outputs[0]
        token_ids = list(c.token_ids)
        return Completion(token_ids, c.text, _sampled_logprobs(c.logprobs, token_ids), c.finish_reason or "abort")

    def _sampling_params(self, spec: SamplingSpec, seed: int | None) -> Any:
        return self._SamplingParams(
            n=1,
            temperature=spec.temperature,
            top_p=1.0 if spec.top_p is None else spec.top_p,
            max_tokens=spec.max_new_tokens,
            stop=list(spec.stop) or None,
            seed=seed,
            logprobs=0,  # the sampled token's logprob only
            flat_logprobs=True,  # flat lists instead of a dict per token: less GC work per sample
            output_kind=self._final_only,  # n>1 cumulative outputs can miss samples (vllm-cpu-notes)
        )

    async def abort(self, request_ids: list[str]) -> None:
        await self._llm.abort(request_ids)

    async def reload(
        self, path: str, *, keep_running: bool = False, before_resume: Callable[[], None] | None = None
    ) -> None:
        if not keep_running:  # nothing in flight (the engine drained): apply, then drop the prefix cache
            results = await self._llm.collective_rpc("forkrl_reload_safetensors", args=(path,))
            self._epoch += 1
            self.last_reload_s = max(float(r["seconds"]) for r in results)
            await self._llm.reset_prefix_cache()
            if before_resume is not None:
                before_resume()
            log.debug("reload results: %s", results)
            return
        # The engine core's own pause, not AsyncLLM.pause_generation: that one also sleeps 20 ms (only to
        # order log output) and clears the multi-modal cache, both pure stall here. "keep" returns once the
        # step in progress is done and its outputs are queued; clear_cache=False keeps the running requests'
        # KV blocks (a reset would preempt them and recompute every prompt: a stall of a full prefill).
        core = self._llm.engine_core
        await core.pause_scheduler_async(mode="keep", clear_cache=False)
        try:
            results = await self._llm.collective_rpc("forkrl_reload_safetensors", args=(path,))
            self._epoch += 1
            self.last_reload_s = max(float(r["seconds"]) for r in results)
            if before_resume is not None:
                before_resume()
        finally:
            await core.resume_scheduler_async()
        log.debug("reload results (in flight kept): %s", results)

    def num_unfinished(self) -> int:
        return int(self._llm.get_num_unfinished_requests())

    def errored(self) -> bool:
        """True once the engine core died (e.g. a crash inside a kernel); it never recovers by itself."""
        return bool(self._llm.errored)

    def shutdown(self) -> None:
        import gc

        self._llm.shutdown()
        # Drop the engine now: AsyncLLM.__del__ calls shutdown() again, which fails noisily when it
        # only runs during interpreter teardown.
        del self._llm
        gc.collect()


def _sampled_logprobs(lp: Any, token_ids: list[int]) -> list[float]:
    """Logprob of each sampled token from vLLM's FlatLogprobs (or list-of-dicts) output."""
    if lp is None:
        return []
    if hasattr(lp, "start_indices"):  # FlatLogprobs: with logprobs=0 one entry per position
        if len(lp.logprobs) == len(token_ids) and list(lp.token_ids) == token_ids:
            return list(lp.logprobs)
        out = []
        for k, t in enumerate(token_ids):
            lo, hi = lp.start_indices[k], lp.end_indices[k]
            out.append(lp.logprobs[lo + list(lp.token_ids[lo:hi]).index(t)])
        return out
    return [pos[t].logprob for pos, t in zip(lp, token_ids, strict=True)]
