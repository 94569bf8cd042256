"""Settings of the rollout service: CLI flags (kebab-case, 1:1 with the fields) or `ROLLOUT_*` variables.

    python -m rollout_service --model forkrl/models/default --port 50051 --kv-cache-gib 1
    ROLLOUT_MODEL=forkrl/models/default ROLLOUT_DTYPE=bfloat16 python -m rollout_service

Imports nothing heavy: `--help` must stay instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from forkrl.cli import TokenSettings


class RolloutSettings(TokenSettings):
    """gRPC rollout service: vLLM's async engine behind Generate, UpdateWeights, LoadWeights and GetInfo."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_", cli_prog_name="python -m rollout_service")

    model: str
    """HF checkpoint directory to serve (config.json, tokenizer files, *.safetensors). Its safetensors
    headers are the reference that pushed weights are checked against."""
    host: str = "127.0.0.1"
    """Address to listen on. Any address but loopback needs a token (the service refuses to start without)."""
    port: int = Field(50051, ge=0, le=65535)
    """gRPC port (0 = any free port, printed at start)."""
    backend: Literal["auto", "vllm"] = "auto"
    """What generates: vLLM's async engine, always (auto and vllm both mean it; the flag stays so that launch lines
    naming it keep working). The engine settings below (kv_cache_gib, gpu_memory_utilization, enforce_eager,
    engine_mode, weight_transfer) are vLLM's; their defaults depend on the device (rollout_service/engine_args.py)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Engine dtype. float32 is the safe CPU default and matches the trainer's fp32 logprobs (to float32
    rounding); bfloat16 is faster but its logprobs differ from the trainer's by far more (the IS ratio and the
    clip then see that gap; docs/results.md has a measurement)."""
    max_model_len: int | None = Field(None, gt=0)
    """Longest prompt + completion in tokens (default: the model's max_position_embeddings)."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """Memory for the KV cache in GiB. Default: 1 on CPU (vLLM's CPU backend takes most of the RAM when unset); on a
    GPU, what gpu_memory_utilization leaves after the weights, activations and CUDA graphs (vLLM's profiling)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """GPU only: the fraction of the GPU's memory the engine may use in all (weights, activations, CUDA graphs, KV
    cache; vLLM's gpu_memory_utilization). vLLM refuses to start unless this fraction is free at the start, even
    with kv_cache_gib given, so a rollout sharing its GPU with the trainer sets it low (compose.gpu.yaml's 1-GPU
    layout: 0.3). Default 0.9 (a GPU of its own)."""
    enforce_eager: bool | None = None
    """Skip graph capture / torch.compile. Default: on CPU (a faster start, about the same throughput there);
    off on a GPU (CUDA graphs: faster decoding, about a minute more at start)."""
    threads: int | None = Field(None, gt=0)
    """CPU threads for the model (OMP_NUM_THREADS of the engine; in mp mode also binds cores
    0..threads-1). Default: vLLM's automatic choice (all cores)."""
    seed: int = 0
    """Engine seed (requests without a seed draw from it)."""
    engine_mode: Literal["uni", "mp"] = "uni"
    """Where the model runs. uni: inside vLLM's engine-core process (2 processes in all: a faster start and
    one worker process less in memory); mp: in a separate worker process with vLLM's OpenMP core binding (vLLM's default
    on CPU). The gRPC server runs apart from the model in both."""
    swap_mode: Literal["inplace", "drain"] = "inplace"
    """How pushed weights replace the served ones. inplace: between two engine steps, the samples in flight
    continue under the new weights (vLLM's scheduler is paused in its "keep" mode for the reload, then resumes:
    generation stalls for the reload; a sample reports the versions it was sampled with, first and last);
    drain: new samples wait until every sample in flight has finished, so each sample has one version, but
    generation runs dry for the drain (bench/bench_swap.py measures both)."""
    weight_transfer: Literal["auto", "gloo", "nccl", "none"] = "auto"
    """The backend of vLLM's weight-transfer API the engine offers for pushes (InitWeightTransfer ...
    FinishWeightUpdate: the trainer broadcasts the weights layer by layer into the engine's workers). auto: gloo
    on CPU (forkrl/weights/transfer_gloo.py), vLLM's nccl on a GPU; none: pushes only by UpdateWeights and
    LoadWeights."""
    transfer_timeout_s: float = Field(300.0, gt=0)
    """A weight-transfer push that sees no call for this long is ended without a commit (generation resumes; the
    weights are reported broken if a chunk had arrived); also how long one broadcast waits for the trainer."""
    max_num_seqs: int = Field(256, gt=0)
    """Most sequences the engine batches at once (vLLM's max_num_seqs)."""
    max_prompts_per_request: int = Field(16384, gt=0)
    """Most prompts one Generate call may carry (INVALID_ARGUMENT beyond, naming this setting)."""
    max_samples_per_request: int = Field(65536, gt=0)
    """Largest len(prompts) * n one Generate call may ask for."""
    max_request_tokens: int = Field(1 << 28, gt=0)
    """Largest len(prompts) * n * max_new_tokens one Generate call may ask for (the tokens it may generate;
    the default allows a 512 x 16 x 20480 DAPO step on one service)."""
    max_prompt_chars: int = Field(1 << 20, gt=0)
    """Longest text prompt in characters (checked before it is tokenized; token-id prompts are bounded by
    max_model_len)."""
    allowed_roots: Annotated[list[str], NoDecode] = ["runs", "models"]
    """Directories LoadWeights may read (comma-separated), besides the served model's own directory and the
    shared-memory sync dir (/dev/shm/forkrl-sync-<uid>, FORKRL_SYNC_DIR; the trainer's --weight-sync auto/shm; only
    while it is this user's alone: owned by this uid, mode 0700). A path must resolve, symlinks followed, inside one
    of them (the trainer's runs_root, for --weight-sync path)."""
    staging_dir: str | None = None
    """Where pushed weights are assembled as a safetensors file before the reload (default:
    /dev/shm/forkrl-rollout-<uid> when /dev/shm is writable, so the engine reads them from memory; else
    <cache>/weights-staging). Created 0700; an existing one owned by another user, a symlink, or with a group/other
    write bit is refused at start-up (forkrl/weights/shm.py private_dir)."""
    lease_timeout_s: float = Field(900.0, gt=0)
    """The rollout lease (the run whose pushes it accepts) expires after this many seconds without a push from
    its run; a run releases it itself when it ends."""
    drain_timeout_s: float = Field(300.0, ge=0)
    """A weight swap waits at most this long for the samples in flight; then it aborts them (their Generate
    calls end UNAVAILABLE and are sampled again) and swaps. 0 = wait without limit."""
    grace_s: float = Field(5.0, ge=0)
    """On SIGTERM: seconds in-flight RPCs get to finish before they are cancelled."""
    max_message_mib: int = Field(64, gt=4)
    """gRPC send/receive message limit in MiB. Pushed weights arrive in chunks of at most 4 MiB
    (forkrl/weights/chunks.py), so this bounds Generate requests (many prompts) and any one message."""
    max_concurrent_streams: int = Field(64, gt=0)
    """gRPC: most RPCs one client connection may have open at once (more wait in the client)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the service (vLLM's own logging follows VLLM_LOGGING_LEVEL)."""

    @field_validator("allowed_roots", mode="before")
    @classmethod
    def _split_roots(cls, v: object) -> object:
        # ROLLOUT_ALLOWED_ROOTS=a,b arrives as one string (NoDecode: not JSON); the CLI splits commas itself
        if isinstance(v, str):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    def load_roots(self) -> list[Path]:
        """Real paths LoadWeights may read: allowed_roots, the served model's directory and the sync dir (only when
        it is this user's alone: another user's folder there could hold any weights)."""
        from forkrl.weights.shm import default_sync_dir, is_private_dir  # imports torch: per LoadWeights

        sync = default_sync_dir()
        extra = [sync] if sync is not None and is_private_dir(sync) else []
        return [Path(r).expanduser().resolve() for r in (*self.allowed_roots, self.model, *extra)]


def apply_engine_env(settings: RolloutSettings) -> None:
    """Set the process environment the engine reads at import: call before torch/vLLM are imported."""
    import os

    from forkrl.runtime import apply_runtime_env, mark_service_process

    # A torch.cuda.is_available() in this process before vLLM is imported (vLLM sets this variable on import: too
    # late for a query made earlier) would initialize CUDA here; vLLM then forks its engine core into a process
    # where CUDA cannot start. The NVML-based check answers without initializing CUDA.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    apply_runtime_env(threads=settings.threads)
    mark_service_process()  # the engine's processes end with this one, also on SIGKILL (worker_ext.py)
    # The KV cache size is passed as kv_cache_memory_bytes; vLLM's CPU platform would let the legacy
    # integer-GiB variable (which apply_runtime_env defaults to 1) override it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # uni: the model runs in the engine-core process (no separate worker process).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if settings.engine_mode == "uni" else "1"
    if settings.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(settings.threads)
        if settings.engine_mode == "mp":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{settings.threads - 1}"
