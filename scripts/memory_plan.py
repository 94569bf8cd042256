"""Memory per GPU of forkrl's trainer (FSDP2) and rollout engine (vLLM), and the smallest layout that fits.

    python scripts/memory_plan.py                            # the tables of docs/scaling.md "Memory plan"
    python scripts/memory_plan.py --model qwen3-14b --ranks 8 --rollout-tp 1    # every term of one layout
    python scripts/memory_plan.py --model /models/Qwen3-14B-Base/config.json --gpu 80   # a local HF config
    python scripts/memory_plan.py --model qwen2.5-1.5b --ranks 4 --rollout-tp 1         # the seed's layout
    python scripts/memory_plan.py --model qwen3-8b --ranks 8 --no-checkpointing --grad-sync last   # each switch's cost

No torch: formulas over a model config (a preset or a config.json path) and a recipe (--recipe, default
recipes/dapo_paper.toml), each term printed; docs/scaling.md "Memory plan" explains them and
bench/bench_memory.py checks them against a measured CPU step. Trainer (as coded: the recipe's
activation_checkpointing, gradients reduce-scattered every micro-batch, the loss from the final hidden states in
chunks), per rank of W: fp32 master weights, AdamW moments and fp32 gradients (FSDP2 shards; unsharded with
--grad-sync last), FSDP2's gathered units, the activations of one micro-batch of ceil(micro_batch_size / W) rows
(with max_tokens_per_micro_batch T: the largest micro-batch T allows, whole on one rank: Run.micro_shapes)
(each layer's saved tensors, or its input with activation checkpointing, plus the largest of the loss phase, the
layer phase and FSDP2's reduce-scatter of the root unit), the step's tokens, runtime and fragmentation. Compute in
bf16 with FSDP2 on CUDA (W > 1), fp32 on one process. Engine, per GPU of a tensor-parallel replica: bf16 weights,
activations, runtime, CUDA graphs, and the KV cache left under gpu_memory_utilization.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the rollout service's GPU defaults: the plan uses the engine the service builds (imports nothing heavy)
from rollout_service.engine_args import GPU_MEMORY_UTILIZATION  # noqa: E402

# Model shapes (the HF config.json keys that matter), copied from the published config.json files.
_Q25 = dict(model_type="qwen2", vocab_size=151936, head_dim=128)
_Q3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, tie_word_embeddings=False)
PRESETS: dict[str, dict] = {
    "qwen2.5-1.5b": {**_Q25, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2.5-7b": {**_Q25, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "tie_word_embeddings": False},
    "qwen2.5-32b": {**_Q25, "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
                    "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
                    "tie_word_embeddings": False},
    "qwen3-8b": {**_Q3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8},
    "qwen3-14b": {**_Q3, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "num_key_value_heads": 8},
    "qwen3-32b": {**_Q3, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "num_key_value_heads": 8},
}
GPUS = {"80": 81559 * (1 << 20), "141": 143771 * (1 << 20)}  # H100 80GB / H200 as nvidia-smi reports them
# Stated allowances (not derived from the model): see docs/scaling.md "Memory plan".
TRAINER_RUNTIME = 1.5 * GIB  # CUDA context, cuBLAS workspaces, NCCL buffers
ENGINE_RUNTIME = 1.0 * GIB  # CUDA context and vLLM's non-torch memory
CUDA_GRAPHS = 1.0 * GIB  # without enforce_eager: the rollout service's default on a GPU (engine_args.py)
FRAGMENTATION = 0.10  # the caching allocator's rounding and fragmentation, on top of the tensors
CHUNK_ROWS = 1024  # response rows per softmax chunk (forkrl/rl/entropy.py default)


@dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_config(cls, cfg: dict, name: str) -> Shape:
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        kind = cfg.get("model_type", "")
        return cls(name, int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), heads,
                   int(cfg.get("num_key_value_heads") or heads),
                   int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads), int(cfg["intermediate_size"]),
                   bool(cfg.get("tie_word_embeddings", False)), bool(cfg.get("attention_bias", kind == "qwen2")),
                   kind == "qwen3")

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_tensors(self) -> list[tuple[int, int]]:
        """(dim 0, elements per dim-0 row) of each parameter of one decoder layer (HF Qwen2/Qwen3 names)."""
        h, q, kv, i = self.hidden, self.q, self.kv, self.inter
        t = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i), (h, 1), (h, 1)]  # q k v o gate up down norms
        t += [(q, 1), (kv, 1), (kv, 1)] if self.qkv_bias else []
        t += [(self.head_dim, 1), (self.head_dim, 1)] if self.qk_norm else []
        return t

    def root_tensors(self) -> list[tuple[int, int]]:
        """embed_tokens, the final norm, lm_head (absent when tied to the embeddings)."""
        return [(self.vocab, self.hidden), (self.hidden, 1)] + ([] if self.tied else [(self.vocab, self.hidden)])

    def tensors(self) -> list[tuple[int, int]]:
        return self.layer_tensors() * self.layers + self.root_tensors()

    @property
    def params(self) -> int:
        return sum(d * r for d, r in self.tensors())

    @property
    def layer_params(self) -> int:
        return sum(d * r for d, r in self.layer_tensors())

    @property
    def root_params(self) -> int:
        return sum(d * r for d, r in self.root_tensors())


def shard_elems(tensors: list[tuple[int, int]], ranks: int) -> int:
    """Elements per rank of FSDP2 shards: each tensor split on dim 0, padded to ceil(dim0 / ranks) rows."""
    return sum(-(-d // ranks) * r for d, r in tensors)


def load_shape(model: str) -> Shape:
    if model in PRESETS:
        return Shape.from_config(PRESETS[model], model)
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        sys.exit(f"--model: {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json path")
    return Shape.from_config(json.loads(path.read_text()), path.parent.name or str(path))


@dataclass(frozen=True)
class Run:
    """The recipe's numbers that size memory (RunConfig field names) and the prompt length (not in a recipe)."""

    prompts_per_step: int = 512
    group_size: int = 16
    mini_batch_prompts: int = 32
    micro_batch_size: int = 4
    max_tokens_per_micro_batch: int = 0  # > 0: micro-batches by tokens (forkrl/rl/microbatch.py), not rows
    max_new_tokens: int = 20480
    prompt_tokens: int = 2048  # DAPO's verl scripts cap prompts at 2048 tokens
    temperature: float = 1.0
    ppo_epochs: int = 1
    activation_checkpointing: bool = True

    @classmethod
    def from_recipe(cls, path: Path, **overrides: int | None) -> Run:
        try:
            import tomllib
        except ModuleNotFoundError:
            sys.exit("--recipe needs Python >= 3.11 (tomllib)")
        doc = tomllib.loads(path.read_text())
        keys = set(cls.__dataclass_fields__)
        vals = {k: v for k, v in doc.items() if k in keys}
        vals.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**vals)

    @property
    def seqs(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def updates(self) -> int:
        per = self.mini_batch_prompts or self.prompts_per_step
        return -(-self.prompts_per_step // per) * self.ppo_epochs

    @property
    def seq(self) -> int:
        return self.prompt_tokens + self.max_new_tokens

    @property
    def micros_per_update(self) -> int:
        """Micro-batches per update (by tokens: the most, every row at full length)."""
        rows = (self.mini_batch_prompts or self.prompts_per_step) * self.group_size
        per = max(1, self.max_tokens_per_micro_batch // self.seq) if self.max_tokens_per_micro_batch \
            else self.micro_batch_size
        return -(-rows // per)

    def micro_shapes(self, ranks: int) -> list[tuple[int, int, int]]:
        """(rows, padded length, response tokens) of the micro-batches one rank may hold at once, the largest of
        each kind. Fixed: ceil(micro_batch_size / ranks) rows of full length (the step deals each micro-batch's
        rows over the ranks). By tokens (T = max_tokens_per_micro_batch; whole micro-batches go to one rank):
        max(1, T // seq) rows of full length (a row longer than T alone), and the most rows of one length whose
        padded size fits T (k = max(2, ceil(T / seq)) rows of T // k tokens: more tokens, and an attention mask,
        when T is not a multiple of seq)."""
        s, n, t = self.seq, self.max_new_tokens, self.max_tokens_per_micro_batch
        if not t:
            rows = max(1, -(-self.micro_batch_size // ranks))
            return [(rows, s, rows * n)]
        full = max(1, t // s)
        out = [(full, s, full * n)]
        k = max(2, -(-t // s))
        if t // k >= 1:
            out.append((k, t // k, k * min(t // k, n)))
        return out


@dataclass(frozen=True)
class Trainer:
    ranks: int = 8
    device: str = "cuda"
    checkpointing: bool | None = None  # activation checkpointing; None: the run's activation_checkpointing
    grad_sync: str = "every"  # train_step's grad_sync: "every" micro-batch (its default) or "last" only
    mixed_precision: bool | None = None  # bf16 compute; None: on CUDA with FSDP2 (shard_model's default)


AS_CODED = dict(checkpointing=None, grad_sync="every")  # load_policy + train_step: the run's setting, the default
# the same code with one switch flipped, to show what each costs
VARIANTS = {"as coded": AS_CODED, "activation checkpointing off": dict(checkpointing=False, grad_sync="every"),
            "grad_sync last": dict(checkpointing=None, grad_sync="last")}


def layer_bytes_per_token(s: Shape, cb: int, masked: bool, checkpointing: bool) -> dict[str, float]:
    """Bytes one decoder layer saves for backward per token (HF Qwen2/Qwen3, SDPA, no dropout), by part."""
    h, q, kv, i = s.hidden, s.q, s.kv, s.inter
    own_input = cb < 4 or not checkpointing  # RMSNorm saves an fp32 copy of its input (the input itself in fp32)
    out = {"input RMSNorm": (4 if own_input else 0) * h + cb * h}
    if s.qk_norm:
        out["q/k RMSNorm"] = (4 + cb) * (q + kv)
    # with a padding mask HF repeats k/v to every head (no GQA kernel); q, k, v, out, its contiguous copy, lse
    out["attention (SDPA)"] = (cb * 5 * q if masked else cb * (3 * q + 2 * kv)) + 4 * s.heads
    out["post-attention RMSNorm"] = (4 + cb) * h
    out["MLP (gate, up, silu, product)"] = 4 * cb * i
    return out


def loss_terms(s: Shape, rows: int, seq: int, resp: int, cb: int, sharded: bool, cpu: bool = False) -> dict[str, float]:
    """Bytes of the loss phase (forkrl/rl/entropy.py `causal_lm_logprobs_and_entropy`), from the end of the
    backbone's forward to the gradient of its final hidden states, by part; the last entry is their peak."""
    v, h, t = s.vocab, s.hidden, rows * seq
    chunk = min(CHUNK_ROWS, resp) * v
    out = {"the final RMSNorm's saved tensors": (4 + cb) * t * h,
           "the response rows' final hidden states (kept for the backward)": cb * resp * h}
    # forward, per chunk: z = h W^T (and its fp32 copy under bf16), then logsumexp's exp and the entropy's p
    fwd = 8.0 * chunk
    # backward, per chunk: the recomputed fp32 softmax (in place into the gradient) and its bf16 copy, and under
    # bf16 the chunk's product dz^T h before it joins the fp32 accumulator; the rows' gradient; the accumulator
    bwd = (6.0 * chunk + cb * v * h if cb < 4 else 4.0 * chunk) + cb * resp * h + 4 * v * h
    bwd += 4 * v * h if cpu and cb < 4 else 0  # the CPU's bf16 matmul writes dz^T h in fp32 first
    # then the gradient of the whole [r, S, h] final hidden states (zeros + the rows put in), lm_head's gradient
    # (sharded: unsharded until the root's reduce-scatter; one process: already in the fp32 gradients)
    after = 2 * cb * t * h + (cb * v * h if sharded else 0)
    out["a chunk's logits temporaries (forward), or the backward's (+ rows' gradient, fp32 lm_head accumulator)"] = \
        max(fwd, bwd, after)
    return out


def trainer_terms(s: Shape, run: Run, tr: Trainer) -> list[tuple[str, str, float]]:
    """(phase, name, bytes) per rank, the last one the total = the terms of phase "" + the largest phase sum, for
    the micro-batch of the run (Run.micro_shapes) that takes the most."""
    plans = [_trainer_terms(s, run, tr, *shape) for shape in run.micro_shapes(tr.ranks)]
    return max(plans, key=lambda t: t[-1][2])


def _trainer_terms(s: Shape, run: Run, tr: Trainer, rows: int, seq: int, resp: int) -> list[tuple[str, str, float]]:
    """trainer_terms for a micro-batch of `rows` rows padded to `seq` tokens, `resp` of them response tokens.

    Phase "loss": from the end of the forward to the final hidden states' gradient (the chunked loss);
    phase "layer": the backward through the decoder layers (units gathered again, one layer recomputed);
    phase "root" (FSDP2): the end of the backward, when the root unit's gradients are reduce-scattered.
    """
    w = tr.ranks
    sharded = w > 1
    ckpt = run.activation_checkpointing if tr.checkpointing is None else tr.checkpointing
    cb = 2 if (tr.mixed_precision if tr.mixed_precision is not None else tr.device == "cuda" and sharded) else 4
    tok, h = rows * seq, s.hidden
    masked = rows > 1  # right-padded rows of different lengths: SDPA gets a boolean mask, no flash kernel
    n_tensors = len(s.layer_tensors()) * s.layers + len(s.root_tensors())
    shard = shard_elems(s.tensors(), w)
    t: list[tuple[str, str, float]] = [
        ("", "fp32 master weights (sharded)", 4 * shard),
        ("", "AdamW exp_avg + exp_avg_sq (sharded)", 8 * shard),
        ("", "AdamW step counters", 4 * n_tensors),
    ]
    if sharded and tr.grad_sync == "last" and run.micros_per_update > 1:
        t.append(("", "fp32 gradients, unsharded (accumulated without reduce-scatter)", 4 * s.params))
    else:
        t.append(("", "fp32 gradients (sharded)", 4 * shard))
    per_tok = layer_bytes_per_token(s, cb, masked, ckpt)
    layer = sum(per_tok.values()) * tok + (cb * rows * seq * seq if masked else 0)  # + SDPA's float mask
    saved = (s.layers * cb * tok * h) if ckpt else s.layers * layer
    saved += rows * seq * seq if masked else 0  # the boolean mask, shared by every layer
    t.append(("", "activations saved: " + ("each layer's input (checkpointing)" if ckpt else "every layer's tensors"),
              saved))
    # FSDP2: the root is not resharded after its forward: gathered from the forward to its post-backward, which
    # reshards it before reducing its gradients
    root = [("FSDP2: root unit gathered (embeddings, norm, lm_head)", cb * s.root_params)] if sharded else []
    cpu = tr.device == "cpu"
    t += [("loss", n, b) for n, b in root + list(loss_terms(s, rows, seq, resp, cb, sharded, cpu).items())]
    if sharded:
        grad_work = cb + (4 if cb < 4 else 0)  # the layer's gradient + its fp32 copy for the reduce-scatter
        t += [("layer", *root[0]),
              ("layer", "FSDP2: 2 decoder layers gathered (current + prefetch)", 2 * cb * s.layer_params),
              ("layer", "FSDP2: one layer's gradient + its fp32 reduce copy" + (" (+ gloo's copy)" if cpu else ""),
               (grad_work + (4 if cpu else 0)) * s.layer_params),
              ("layer", "lm_head gradient, unsharded until the root's reduce-scatter", cb * s.vocab * h)]
    if ckpt:
        t.append(("layer", "one layer recomputed (its saved tensors)", layer))
    t.append(("layer", "backward temporaries (gradients of the MLP's intermediates)", 2 * cb * tok * s.inter))
    if sharded:  # the backward's final callback, after every layer: the root's unsharded gradients are copied into
        # an fp32 reduce-scatter input, then freed but the embedding's (autograd still holds it), and reduced into
        # an output of 1/W of it; gloo's reduce-scatter (CPU) reduces a copy of its input
        pad = 4 * shard_elems(s.root_tensors(), w) * w  # FSDP2 pads every tensor's dim 0 to a multiple of W
        t.append(("root", "FSDP2: the root's gradients, then their fp32 reduce-scatter input and output",
                  max(cb * s.root_params + pad, cb * s.vocab * h + pad * (2 if cpu else 1) + pad / w)))
    if tr.device == "cuda":
        step_rows = -(-run.seqs // w)
        # ids, masks, logps
        per_row = 26 * run.seq - (4 * run.seq if run.updates == 1 else 0) + 8 * run.max_new_tokens
        t.append(("", "the step's token tensors on the device (this rank's rows)", step_rows * per_row))
    phases = {ph: sum(b for p, _, b in t if p == ph) for ph in ("loss", "layer", "root")}
    peak = max(phases, key=lambda ph: phases[ph])
    tensors = sum(b for ph, _, b in t if not ph) + phases[peak]
    t += [("", f"{ph} phase total", b) for ph, b in phases.items() if sharded or ph != "root"]
    if tr.device == "cuda":
        t += [("", f"allocator fragmentation ({FRAGMENTATION:.0%} of the tensors)", FRAGMENTATION * tensors),
              ("", "runtime: CUDA context, cuBLAS, NCCL", TRAINER_RUNTIME)]
        tensors += FRAGMENTATION * tensors + TRAINER_RUNTIME
    t.append(("", "total per rank", tensors))
    return t


@dataclass(frozen=True)
class Engine:
    tp: int = 1
    gpu: float = GPUS["80"]
    utilization: float = GPU_MEMORY_UTILIZATION  # the rollout service's default on a GPU (--gpu-memory-utilization)
    max_num_seqs: int = 256  # the rollout service's default
    max_num_batched_tokens: int = 2048  # vLLM's default for AsyncLLM with chunked prefill
    eager: bool = False  # the rollout service's default on a GPU: CUDA graphs


def engine_terms(s: Shape, run: Run, e: Engine) -> tuple[list[tuple[str, float]], float, int]:
    """(name, bytes) per GPU of one replica, the KV cache left for it, and how many max-length sequences fit."""
    tp, seq = e.tp, run.prompt_tokens + run.max_new_tokens
    w = 2 * s.params / tp
    t = [("bf16 weights (/ TP)", w)]
    acts = e.max_num_batched_tokens * (3 * s.inter + s.q + 2 * s.kv) * 2 / tp + e.max_num_batched_tokens * 4 * s.hidden
    t += [("activations: max_num_batched_tokens through a layer", acts),
          ("sampler: fp32 logits, log-probs, probs of max_num_seqs rows", 3 * e.max_num_seqs * s.vocab * 4),
          ("CUDA graphs" + (" (none: enforce_eager)" if e.eager else ""), 0.0 if e.eager else CUDA_GRAPHS),
          ("runtime: CUDA context, vLLM non-torch", ENGINE_RUNTIME)]
    kv_tok = 2 * s.layers * -(-s.kv_heads // tp) * s.head_dim * 2  # K and V, bf16, this GPU's kv heads
    kv = e.utilization * e.gpu - sum(b for _, b in t)
    need = kv_tok * seq * e.max_num_seqs
    t.append((f"KV cache: max_num_seqs x {seq} tokens would need", need))
    t.append((f"KV cache left under gpu_memory_utilization {e.utilization}", max(kv, 0.0)))
    return t, kv, max(0, int(kv // (kv_tok * seq)))


def smallest_tp(s: Shape, run: Run, e: Engine, min_seqs: int = 1) -> tuple[int, int] | None:
    """The fewest tensor-parallel GPUs (1, 2, 4, 8; dividing the heads) whose KV cache holds min_seqs
    max-length sequences, and how many it holds."""
    for tp in (1, 2, 4, 8):
        if s.heads % tp == 0:
            _, _, fits = engine_terms(s, run, replace(e, tp=tp))
            if fits >= min_seqs:
                return tp, fits
    return None


def smallest_ranks(s: Shape, run: Run, tr: Trainer, gpu: float, max_ranks: int = 1024) -> tuple[int, float] | None:
    """The fewest trainer ranks whose per-rank total fits the GPU, and that total."""
    for w in range(1, max_ranks + 1):
        total = trainer_terms(s, run, replace(tr, ranks=w))[-1][2]
        if total <= gpu:
            return w, total
    return None


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


def _largest(s: Shape, run: Run, tr: Trainer) -> str:
    """The largest single term (phase totals and the total left out): why nothing fits."""
    terms = [(b, n) for ph, n, b in trainer_terms(s, run, tr) if "total" not in n and "fragmentation" not in n]
    b, n = max(terms)
    return f"{n.split(': ')[-1]}: {_gib(b)} GiB"


def layouts_table(models: list[str], run: Run, gpus: list[str], max_ranks: int, min_seqs: int) -> str:
    ckpt = "on" if run.activation_checkpointing else "off"
    lines = ["| model | params | GPU | rollout GPUs: TP (max-length seqs in its KV cache) | trainer as coded "
             f"(activation checkpointing {ckpt}, reduce-scatter every micro-batch): ranks (GiB/rank) | " +
             " | ".join(f"trainer, {k}: ranks (GiB/rank)" for k in list(VARIANTS)[1:]) +
             " | smallest layout as coded (rollout + trainer) |", "|" + "---|" * (5 + len(VARIANTS))]
    for m in models:
        s = load_shape(m)
        for g in gpus:
            eng = smallest_tp(s, run, Engine(gpu=GPUS[g]), min_seqs)
            cells, lay = [], "-"
            for label, variant in VARIANTS.items():
                tr = Trainer(**variant)
                r = smallest_ranks(s, run, tr, GPUS[g], max_ranks)
                why = "" if r else _largest(s, run, replace(tr, ranks=max_ranks))
                cells.append(f"{r[0]} ({_gib(r[1])})" if r else f"none up to {max_ranks} ({why} per rank alone)")
                if r and eng and label == "as coded":
                    lay = f"{eng[0]} + {r[0]} = {eng[0] + r[0]}"
            tp = f"{eng[0]} ({eng[1]})" if eng else "none up to TP 8"
            lines.append(f"| {s.name} | {s.params / 1e9:.2f} B | {g} GB | {tp} | {' | '.join(cells)} | {lay} |")
    return "\n".join(lines)


def layout_check(model: str, run: Run, gpus: list[str], tp: int, ranks: int) -> str:
    """Does a given layout fit (the seed's: 1 rollout GPU + 4 trainer ranks), per trainer variant."""
    s = load_shape(model)
    lines = [f"| {s.name}: {tp} rollout GPU(s) + {ranks} trainer ranks | GPU | " +
             " | ".join(f"trainer {k}, GiB/rank" for k in VARIANTS) + " | engine: max-length seqs in its KV cache |",
             "|" + "---|" * (3 + len(VARIANTS))]
    for g in gpus:
        cells = []
        for variant in VARIANTS.values():
            total = trainer_terms(s, run, Trainer(ranks=ranks, **variant))[-1][2]
            cells.append(f"{_gib(total)} ({'fits' if total <= GPUS[g] else 'does not fit'})")
        seqs = engine_terms(s, run, Engine(tp=tp, gpu=GPUS[g]))[2]
        lines.append(f"| | {g} GB | {' | '.join(cells)} | {seqs} |")
    return "\n".join(lines)


def terms_table(models: list[str], run: Run, tr: Trainer, e: Engine) -> str:
    shapes = [load_shape(m) for m in models]
    cols = [{(f"[{ph} phase] " if ph else "") + n: b for ph, n, b in trainer_terms(s, run, tr)} for s in shapes]
    names = list(dict.fromkeys(n for c in cols for n in c))
    lines = [f"| trainer, per rank ({tr.ranks} ranks), GiB | " + " | ".join(s.name for s in shapes) + " |",
             "|---|" + "---|" * len(shapes)]
    lines += [f"| {n} | " + " | ".join(_gib(c[n]) if n in c else "-" for c in cols) + " |" for n in names]
    ecols = [dict(engine_terms(s, run, e)[0]) for s in shapes]
    enames = list(dict.fromkeys(n for c in ecols for n in c))
    lines += ["", f"| engine, per GPU (TP {e.tp}, {e.gpu / GIB:.1f} GiB GPU), GiB | " +
              " | ".join(s.name for s in shapes) + " |", "|---|" + "---|" * len(shapes)]
    lines += [f"| {n} | " + " | ".join(_gib(c[n]) for c in ecols) + " |" for n in enames]
    lines.append("| max-length sequences the KV cache holds | " +
                 " | ".join(str(engine_terms(s, run, e)[2]) for s in shapes) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help=f"a preset ({', '.join(PRESETS)}) or a config.json path "
                   "(repeatable; default: every preset)")
    p.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "dapo_paper.toml", help="a RunConfig TOML "
                   "(its batch, mini-batch, micro-batch, max_new_tokens, temperature, ppo_epochs, "
                   "activation_checkpointing)")
    p.add_argument("--prompt-tokens", type=int, help="longest prompt in tokens (default 2048)")
    p.add_argument("--max-new-tokens", type=int, help="override the recipe's response length")
    p.add_argument("--micro-batch-size", type=int, help="override the recipe's micro_batch_size (global rows)")
    p.add_argument("--max-tokens-per-micro-batch", type=int, help="override the recipe's max_tokens_per_micro_batch "
                   "(> 0: micro-batches by padded tokens, whole ones per rank; 0: micro_batch_size rows)")
    p.add_argument("--gpu", choices=list(GPUS), action="append", help="GPU size in GB (default: 80 and 141)")
    p.add_argument("--ranks", type=int, help="print every term for this many trainer ranks instead of searching")
    p.add_argument("--rollout-tp", type=int, default=1, help="tensor-parallel GPUs of the engine (with --ranks)")
    p.add_argument("--no-checkpointing", action="store_true", help="with --ranks: activation checkpointing off "
                   "(default: the recipe's activation_checkpointing)")
    p.add_argument("--grad-sync", choices=["every", "last"], default="every", help="with --ranks: train_step's "
                   "grad_sync (default every: gradients reduce-scattered after every micro-batch)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="with --ranks: cpu = fp32, no "
                   "runtime, fragmentation or device copies (what bench/bench_memory.py measures)")
    p.add_argument("--max-ranks", type=int, default=1024, help="the most trainer ranks the search tries")
    p.add_argument("--min-seqs", type=int, default=1, help="max-length sequences the engine's KV cache must hold")
    a = p.parse_args(argv)
    run = Run.from_recipe(a.recipe, prompt_tokens=a.prompt_tokens, max_new_tokens=a.max_new_tokens,
                          micro_batch_size=a.micro_batch_size, max_tokens_per_micro_batch=a.max_tokens_per_micro_batch)
    models = a.model or list(PRESETS)
    gpus = a.gpu or ["80", "141"]
    micro = (f"up to {run.micros_per_update} micro-batches of <= {run.max_tokens_per_micro_batch} padded tokens each, "
             "whole ones per rank" if run.max_tokens_per_micro_batch else
             f"{run.micros_per_update} micro-batches of {run.micro_batch_size} rows each")
    print(f"recipe {a.recipe.name}: {run.prompts_per_step} prompts x {run.group_size} samples, "
          f"{run.updates} updates per step ({micro}), prompt <= {run.prompt_tokens} + response <= "
          f"{run.max_new_tokens} tokens")
    if a.ranks:
        tr = Trainer(ranks=a.ranks, device=a.device, checkpointing=False if a.no_checkpointing else None,
                     grad_sync=a.grad_sync)
        ckpt = run.activation_checkpointing and not a.no_checkpointing
        for g in gpus:
            print(f"\n{g} GB GPU ({GPUS[g] / GIB:.1f} GiB); trainer: activation checkpointing {ckpt}, "
                  f"gradient sync {tr.grad_sync}\n")
            print(terms_table(models, run, tr, Engine(tp=a.rollout_tp, gpu=GPUS[g])))
        return 0
    print(layouts_table(models, run, gpus, a.max_ranks, a.min_seqs))
    if not a.model:
        print("\nthe seed's layout:\n")
        print(layout_check("qwen2.5-1.5b", run, gpus, tp=1, ranks=4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
