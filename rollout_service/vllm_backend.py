"""The vLLM adapter: the only code in the rollout service that touches vLLM (`AsyncLLM`).

One engine request per sample (FINAL_ONLY outputs, the sampled token's logprob at the request's
temperature), abort, in-place reload through the worker extension (`worker_ext.py`), prefix-cache reset.

Reload with requests in flight (`keep_running=True`, swap mode "inplace"):
- staged (`stage_weights`, the default): the worker loads the file into a shadow of the model (`shadow.py`) in
  slices of `stage_slice_ms`, one per `collective_rpc` and so one between two engine steps, while the engine
  generates (`stage_inline`: on the engine's own thread, the CPU default, or on a staging thread of its own;
  `stage_native_beside`: whether that thread's native calls may run on past its slice); then one
  `collective_rpc` copies the staged tensors in. A utility call runs between two engine steps, and the engine
  core reads its inputs (requests and utility calls) in order and writes its outputs (tokens and utility
  replies) in order, so no pause is needed: requests sent after the apply see only the new weights, and the
  version is committed as soon as the apply's reply arrives, before any later token is seen here. Generation
  stalls for the copy.
- otherwise (and whenever no sample is running: nothing to stall, and it is several times faster) the engine
  core's scheduler is paused in vLLM's "keep" mode (it finishes the step it is in, then
  skips steps with every request kept scheduled, KV cache included), the weights are reloaded through
  `collective_rpc` and the scheduler resumes: generation stalls for those three engine-core calls.
The prefix cache cannot be reset while requests hold KV blocks, so every request carries `cache_salt` = the
weights' epoch (bumped by each reload): a later request never matches a block computed by replaced weights.
vLLM is imported inside the methods, so the rest of the service (and its plumbing tests) imports without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from rollout_service.types import Completion, InvalidArgument, SamplingSpec

log = logging.getLogger("rollout_service")


class _StagingFailed(Exception):
    """The background load into the shadow model failed; the served weights were not touched."""


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
        self.last_stage_s = 0.0  # staged swaps: the background load before the apply (generation goes on)
        self.last_stage_slices = 0  # ... in how many slices between engine steps
        self.last_max_slice_s = 0.0  # ... the longest of them (what one engine step was delayed by at most)
        self.last_max_slice_cpu_s = 0.0  # ... the CPU time of the staging's work in it (steal and waits left out)
        self.last_copy_cpu_s = 0.0  # the CPU time of the apply's copy
        self.last_longest_slice: dict[str, float] = {}  # the longest slice: wall, CPU, waits (worker_ext)
        self.last_longest_stretch: dict[str, Any] = {}  # inline: the longest stretch between checkpoints (CPU, where)
        self.last_apply: list[dict[str, Any]] = []  # the workers' apply reports
        self.stage_weights = bool(getattr(settings, "stage_weights", False))
        self.stage_slice_ms = float(getattr(settings, "stage_slice_ms", 1.0))
        beside = getattr(settings, "stage_native_beside", None)
        # unset: beside on a GPU (copies to the device do not compete with the engine), in the slice on CPU
        self.stage_native_beside = engine_settings.get("device", "cpu") != "cpu" if beside is None else bool(beside)
        inline = getattr(settings, "stage_inline", None)
        # unset: on the engine's thread on CPU (no second thread to hand the cores between), a thread on a GPU
        self.stage_inline = engine_settings.get("device", "cpu") == "cpu" if inline is None else bool(inline)
        self.last_stage_overruns = 0  # slices given up on a native call that did not return (see SliceGate)
        self.stage_failures = 0
        self.last_route = ""  # how the last in-place reload was applied: staged | paused
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
        if self.stage_weights:
            self.engine_settings["stage_inline"] = self.stage_inline
            self.engine_settings["stage_native_beside"] = self.stage_native_beside

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
            "stage_weights": settings.stage_weights,
        }
        backend = cls(llm, settings, engine_settings)
        del llm  # the backend owns the engine; see shutdown()
        if backend.stage_weights:  # the second copy of the weights, made before any sample runs
            try:
                # staged once with the served checkpoint (not applied): a model the staging cannot handle
                # falls back here, before any sample runs
                shadow = await backend._llm.collective_rpc("forkrl_prepare_shadow", args=(settings.model,))
                log.info("staged swaps: a shadow of the model (%.1f MiB) is ready (a trial staging: %.1f ms)",
                         max(r["bytes"] for r in shadow) / 2**20, max(r["trial_s"] for r in shadow) * 1e3)
            except Exception as e:  # the pushes will use pause + reload
                log.warning("staged swaps unavailable (%s: %s): using pause + reload", type(e).__name__, e)
                backend.stage_weights = False
                backend.engine_settings["stage_weights"] = False
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
        # Staging pays off only while samples are generated: with the engine idle (a sync trainer pushes
        # between two steps) pause + reload stalls nothing and takes a fraction of the staging's time.
        if self.stage_weights and self.num_unfinished() > 0:
            try:
                stage_s = await self._stage(path)
            except _StagingFailed as e:
                # the served model was not touched: fall back to pause + reload, now and for later pushes
                log.warning("staged weight swap failed (%s): using pause + reload from now on", e)
                self.stage_weights = False
                self.engine_settings["stage_weights"] = False
                self.stage_failures += 1
            else:
                # Bumped before the apply is sent: requests submitted from here on reach the engine after the
                # apply (one input channel, in order), so they must not match blocks of the replaced weights.
                self._epoch += 1
                results = await self._llm.collective_rpc("forkrl_apply_staged")
                self.last_reload_s = max(float(r["seconds"]) for r in results)
                self.last_stage_s = stage_s
                self.last_stage_slices = max(int(r["slices"]) for r in results)
                self.last_apply = results
                self.last_max_slice_s = max(float(r["max_slice_s"]) for r in results)
                self.last_max_slice_cpu_s = max(float(r["max_slice_cpu_s"]) for r in results)
                self.last_longest_slice = dict(max(results, key=lambda r: float(r["max_slice_s"]))["longest_slice"])
                self.last_copy_cpu_s = max(float(r["copy_cpu_seconds"]) for r in results)
                self.last_longest_stretch = dict(max(results, key=lambda r: float(
                    r.get("longest_stretch", {}).get("cpu_s", 0.0)))["longest_stretch"])
                self.last_stage_overruns = max(int(r.get("overruns", 0)) for r in results)
                self.last_route = "staged"
                # The apply's reply precedes every output of later engine steps on the output channel, so
                # the version is committed before the service sees any token sampled by the new weights.
                if before_resume is not None:
                    before_resume()
                log.debug("staged reload applied: %s", results)
                return
        self.last_route = "paused"
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

    async def _stage(self, path: str) -> float:
        """Load `path` into the worker's shadow model, one slice of `stage_slice_ms` between engine steps."""
        t0 = time.perf_counter()
        try:
            await self._llm.collective_rpc("forkrl_stage_safetensors",
                                           args=(path, self.stage_slice_ms / 1e3, self.stage_native_beside,
                                                 self.stage_inline))
        except Exception as e:
            raise _StagingFailed(f"{type(e).__name__}: {e}") from e
        while True:  # at most one slice per call; the engine core runs a step between two calls
            await asyncio.sleep(self.stage_slice_ms / 2e3)
            states = await self._llm.collective_rpc("forkrl_stage_status")
            failed = [s["error"] for s in states if s["status"] == "failed"]
            if failed:
                raise _StagingFailed(failed[0])
            if all(s["status"] == "ready" for s in states):
                return time.perf_counter() - t0

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
