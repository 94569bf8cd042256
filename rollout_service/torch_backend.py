"""The torch backend: forkrl's own KV-cache sampler on the HF model, inside the rollout service's process.

For models too small for vLLM's per-step engine overhead (a 0.5M-parameter model spends most of a vLLM engine
step outside its own matrix products: docs/results.md, issue 28), `--backend auto` serves them with this
backend instead (the rule: `rollout_service/backends.py`). It keeps the rollout contract: the same Generate,
seeds per sample, the sampled token's logprob under log_softmax(z / T) (vLLM's "processed_logprobs", renormalized
over the nucleus for top_p < 1), EOS kept in the token ids, stop strings, abort, and weight pushes applied in
place between two decode steps with the samples in flight kept (the "inplace" swap), or after a drain.

Batching: the samples submitted together (one Generate's prompts x n, or several calls arriving at once) are
decoded as one left-padded batch of up to `max_num_seqs` rows by `forkrl.models.sampling.sample_rows` in a
worker thread; each sample is handed back the moment it ends. Requests that arrive while a batch runs form the
next one (no continuous batching: at these sizes a decode step is a few milliseconds).

Not offered: vLLM's weight-transfer API (pushes arrive by shm, stream or path: the trainer's `auto` picks them
when the service offers no transfer backend).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_service.types import Completion, FailedPrecondition, SamplingSpec

log = logging.getLogger("rollout_service")
_NO_TRANSFER = "the torch backend has no weight-transfer engine; push by shm, stream or path (--weight-sync)"


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    spec: SamplingSpec
    seed: int | None
    future: asyncio.Future[Completion] = field(repr=False)


class TorchBackend:
    """HF `AutoModelForCausalLM` + forkrl's batched sampler; the `Backend` protocol of `types.py`."""

    def __init__(self, model: Any, tokenizer: Any, settings: Any, max_model_len: int) -> None:
        import torch

        self._model = model
        self._tokenizer = tokenizer
        self._torch = torch
        self.model = settings.model
        self.vocab_size = len(tokenizer)
        cfg = model.config
        self.vocab_limit = max(len(tokenizer), int(getattr(cfg, "vocab_size", 0) or 0))
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else getattr(cfg, "eos_token_id", None)
        eos_ids = eos if isinstance(eos, list) else [eos]
        self._eos = [int(e) for e in eos_ids if e is not None]
        self.eos_token_id = self._eos[0] if self._eos else -1
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
        self._pad = max(int(pad), 0)
        self.max_model_len = max_model_len
        self.max_num_seqs = int(settings.max_num_seqs)
        self._params = dict(model.named_parameters()) | dict(model.named_buffers())
        self.engine_settings = {
            "backend": "torch",
            "dtype": str(settings.dtype),
            "enforce_eager": True,
            "logprobs_mode": "processed_logprobs",
            "kv_cache_gib": 0.0,
            "device": str(next(model.parameters()).device.type),
            "vllm_version": "",
            "engine_mode": "torch",
            "weight_transfer_backend": "",
            "weight_transfer_workers": 0,
            "served_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "max_model_len": max_model_len,
            "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        }
        self.last_reload_s = 0.0
        self._queue: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._aborted: set[str] = set()
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._batcher = asyncio.create_task(self._serve_batches())
        self._seeds = torch.Generator().manual_seed(int(settings.seed))  # seeds of requests without one
        # the decode thread and a reload: a reload waits until no forward pass runs, and none starts until it is done
        self._cond = threading.Condition()
        self._in_step = False
        self._paused = False
        self._error: BaseException | None = None

    @classmethod
    async def start(cls, settings: Any) -> TorchBackend:
        def build() -> tuple[Any, Any, int]:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            if settings.threads is not None:
                torch.set_num_threads(int(settings.threads))
            dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
                     "float16": torch.float16}[settings.dtype]
            tok = AutoTokenizer.from_pretrained(settings.model, local_files_only=True)
            # sdpa keeps the attention rows of left padding finite (eager attention can turn them into NaN that
            # leaks into real rows; forkrl/models/sampling.py refuses to hand on non-finite logprobs)
            model = AutoModelForCausalLM.from_pretrained(settings.model, dtype=dtype, local_files_only=True,
                                                         attn_implementation="sdpa")
            model.eval().requires_grad_(False)
            limit = settings.max_model_len or int(getattr(model.config, "max_position_embeddings", 0) or 2048)
            return model, tok, int(limit)

        model, tok, limit = await asyncio.to_thread(build)
        return cls(model, tok, settings, limit)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    # ------------------------------------------------------------------------------------ generation
    async def generate_one(
        self, request_id: str, prompt_ids: list[int], spec: SamplingSpec, seed: int | None
    ) -> Completion:
        req = _Request(request_id, list(prompt_ids), spec, seed, self._loop.create_future())
        self._queue.append(req)
        self._wake.set()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            await self.abort([request_id])
            raise

    async def _serve_batches(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # the samples submitted in the same loop iteration join this batch
            while self._queue:
                first = self._queue[0].spec
                key = (first.temperature, first.top_p, tuple(first.stop))
                batch = [r for r in self._queue if (r.spec.temperature, r.spec.top_p, tuple(r.spec.stop)) == key]
                batch = batch[: self.max_num_seqs]
                taken = {id(r) for r in batch}
                self._queue = [r for r in self._queue if id(r) not in taken]
                for r in batch:
                    self._running[r.rid] = r
                try:
                    await asyncio.to_thread(self._decode, batch)
                except BaseException as e:  # noqa: BLE001 - the batch's samples fail, the backend goes on
                    log.exception("torch backend: a batch of %d samples failed", len(batch))
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
                finally:
                    for r in batch:
                        self._running.pop(r.rid, None)
                        self._aborted.discard(r.rid)

    def _decode(self, batch: list[_Request]) -> None:
        """Worker thread: one batch to its end, each sample handed back as it ends."""
        torch = self._torch
        from forkrl.models.sampling import RowSample, sample_rows

        spec = batch[0].spec
        gens = []
        for r in batch:
            seed = r.seed if r.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
            gens.append(torch.Generator().manual_seed(int(seed)))
        stops = list(spec.stop)
        texts: dict[int, str] = {}

        def on_token(i: int, row: RowSample) -> bool:
            if not stops:
                return False
            text = self._tokenizer.decode(row.tokens, skip_special_tokens=True)
            for s in stops:
                k = text.find(s)
                if k >= 0:
                    texts[i] = text[:k]  # vLLM's output text ends before the stop string
                    return True
            return False

        ended: list[tuple[asyncio.Future[Completion], Completion]] = []

        def on_done(i: int, row: RowSample) -> None:
            text = texts.get(i)
            if text is None:
                text = self._tokenizer.decode(row.tokens, skip_special_tokens=True)
            ended.append((batch[i].future, Completion(list(row.tokens), text, list(row.logprobs), row.finish)))

        def hand_back() -> None:  # the samples that ended in the last step, in one call into the event loop
            if ended:
                done = ended[:]
                ended.clear()
                self._loop.call_soon_threadsafe(_resolve, done)

        def boundary() -> None:
            hand_back()
            self._step_boundary()

        try:
            sample_rows(
                self._model, [r.prompt for r in batch], [r.spec.max_new_tokens for r in batch], gens,
                temperature=spec.temperature, top_p=1.0 if spec.top_p is None else spec.top_p,
                eos_ids=self._eos, pad_id=self._pad, between_steps=boundary,
                on_token=on_token if stops else None, on_done=on_done,
                aborted=lambda i: batch[i].rid in self._aborted,
            )
            hand_back()
        finally:
            with self._cond:
                self._in_step = False
                self._cond.notify_all()

    def _step_boundary(self) -> None:
        """Between two forward passes: let a waiting reload in, then wait until it is done."""
        with self._cond:
            self._in_step = False
            self._cond.notify_all()
            while self._paused:
                self._cond.wait()
            self._in_step = True

    async def abort(self, request_ids: list[str]) -> None:
        """Queued samples end "abort" at once, running ones at the next decode step; finished ones are left alone
        (only ids still queued or running are remembered, so the set never outgrows what is in flight)."""
        ids = set(request_ids)
        self._aborted.update(ids & self._running.keys())
        for r in [r for r in self._queue if r.rid in ids]:
            self._queue.remove(r)
            if not r.future.done():
                r.future.set_result(Completion([], "", [], "abort"))

    # --------------------------------------------------------------------------------------- weights
    def _pause(self) -> None:
        with self._cond:
            self._paused = True
            while self._in_step:
                self._cond.wait()

    def _resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def _load(self, path: str) -> float:
        import time

        from forkrl.weights.safetensors import check_data_section, checkpoint_files, iter_safetensors

        start = time.perf_counter()
        files = checkpoint_files(path)
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path}")
        for f in files:
            check_data_section(f)
        with self._torch.no_grad():
            for name, t in iter_safetensors(files):
                target = self._params.get(name)
                if target is None:
                    if name == "lm_head.weight" and self.engine_settings["tie_word_embeddings"]:
                        continue  # tied to the embedding: the same tensor arrives as model.embed_tokens.weight
                    raise KeyError(f"{name!r} is not a tensor of the served model")
                target.copy_(t)
        return time.perf_counter() - start

    async def reload(
        self, path: str, *, keep_running: bool = False, before_resume: Callable[[], None] | None = None
    ) -> None:
        """Between two decode steps (the samples in flight kept, continuing under the new weights), or with
        nothing in flight after a drain: the same pause either way."""
        await asyncio.to_thread(self._pause)
        try:
            self.last_reload_s = await asyncio.to_thread(self._load, path)
            if before_resume is not None:
                before_resume()
        finally:
            self._resume()

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        raise FailedPrecondition(_NO_TRANSFER)

    async def start_weight_update(self) -> None:
        raise FailedPrecondition(_NO_TRANSFER)

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        raise FailedPrecondition(_NO_TRANSFER)

    async def finish_weight_update(self, version: int, before_resume: Callable[[], None]) -> None:
        raise FailedPrecondition(_NO_TRANSFER)

    async def abort_weight_update(self) -> None:
        raise FailedPrecondition(_NO_TRANSFER)

    async def shutdown_weight_transfer(self) -> None:
        return None

    def num_unfinished(self) -> int:
        return len(self._queue) + len(self._running)

    def errored(self) -> bool:
        return self._batcher.done()  # the batch loop never ends while the backend lives

    def shutdown(self) -> None:
        self._batcher.cancel()
        self._aborted.update(self._running)


def _resolve(done: list[tuple[asyncio.Future[Completion], Completion]]) -> None:
    for fut, completion in done:
        if not fut.done():
            fut.set_result(completion)
