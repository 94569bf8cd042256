"""Exact per-position gradients of logp(token) w.r.t. chosen rows of chosen Linear weights (§4.2).

For a Linear applied at every position, y_p = W x_p, the gradient of one target L_t = logp_t is

    dL_t/dW[r, :] = sum_{p <= t} G_{t,p,r} x_p,     G_{t,p,r} = dL_t/dy_{p,r}

a sum over all earlier positions, because attention mixes positions downstream of y. So the cheap
"outer-product" shortcut g_t x_t^T from one summed backward is wrong for k_proj/v_proj and for every
module of a non-final block (§4.2 table; verify_probe.py measures the error: docs/results.md).

The exact method (§4.2, `method="vmap"`): one forward per trajectory, cut after its last selected token,
with forward hooks that keep X (inputs) and Y (outputs) of each target Linear; then, for its K selected
positions at once (chunks of `chunk_size`),

    Gt = torch.autograd.grad(logp[t_1..t_K], Ys, grad_outputs=I_K, is_grads_batched=True)   # (K, 1, L, out)
    row grads = einsum('kpr,kpi->kri', Gt[:, 0][..., rows], X)                              # fp32 / fp64

`is_grads_batched` vmaps the backward; if an attention kernel has no batching rule we fall back to a loop
of K backwards with `retain_graph=True` (still exact). Load models with `attn_implementation="eager"`.
Trajectories are not stacked into one padded batch for this: each cotangent is non-zero in one batch row
only, so a B-row batch would do B times the backward work (slower than one row at a time: docs/results.md).

`method="replicate"` is the vmap-free alternative: one row per position (the trajectory cut after that
token), a chunk of rows in one forward and one ordinary backward of sum_k logp_k. The rows are independent,
so row k's output gradient is exactly dlogp_k/dY. On CPU it is the fastest (see bench/bench_probe.py).

Each hooked output is turned into a graph leaf when nothing upstream of it requires grad, so the backward
runs only from the logits down to the lowest probed layer and no parameter needs `requires_grad`.
Disable gradient checkpointing (recomputation would fire the hooks twice). With LoRA/PEFT wrappers the
hook goes on the base layer. For a tied lm_head this is the gradient through the lm_head use only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from forkrl.probe.params import GRAD_METHODS, MODULE_PATHS, ROW_SPEC_PATTERN
from forkrl.seeds import seeded_generator

__all__ = [
    "MODULE_PATHS",
    "GradResult",
    "ProbeTarget",
    "RowSet",
    "build_targets",
    "exact_row_grads",
    "parse_row_spec",
    "reference_row_grads",
    "resolve_layers",
]

KV_MODULES = frozenset({"k_proj", "v_proj"})
DEFAULT_BLOCK_ROWS = 32
_ROW_SPEC_RE = re.compile(ROW_SPEC_PATTERN)


@dataclass(frozen=True)
class RowSet:
    """A named set of weight rows. `spec` is the user's string ("random:32", "start", "0,5,9")."""

    spec: str
    rows: tuple[int, ...]


@dataclass
class ProbeTarget:
    """One probed weight matrix W (out x in) and the row sets whose gradients are kept."""

    module: str  # short name, a key of MODULE_PATHS
    layer: int | None  # non-negative layer index; None for lm_head
    linear: nn.Linear
    row_sets: list[RowSet] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "lm_head" if self.layer is None else f"layers.{self.layer}.{MODULE_PATHS[self.module]}"

    @property
    def rows(self) -> list[int]:
        """Union of all row sets, sorted: the rows whose gradients are computed."""
        return sorted({r for rs in self.row_sets for r in rs.rows})

    def row_index(self, row_set: RowSet) -> list[int]:
        """Positions of `row_set`'s rows inside `self.rows`."""
        pos = {r: i for i, r in enumerate(self.rows)}
        return [pos[r] for r in row_set.rows]


def parse_row_spec(
    spec: str,
    out_features: int,
    *,
    head_dim: int | None = None,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    seed: int = 0,
    salt: str = "",
    single: bool = False,
) -> tuple[int, ...]:
    """Rows of a weight with `out_features` rows selected by `spec`.

    - "start" / "mid" / "last" with `single` (row mode, the seed's grain): one row, 0, out_features // 2 or
      out_features - 1.
    - "start" / "mid" / "last" otherwise: a block of consecutive rows at the start, middle or end. With `head_dim`
      (k_proj/v_proj, whole KV heads) the block is one whole head: the first, middle or last KV head.
      Otherwise the block has `block_rows` rows.
    - "0,5,9": explicit indices (negative ones count from the end).
    - "random:N": N seeded random rows; with `head_dim`, ceil(N / head_dim) random whole heads.
    """
    spec = spec.strip()
    if not _ROW_SPEC_RE.match(spec):
        raise ValueError(f"row spec must be start, mid, last, random:N or comma-separated ints; got {spec!r}")
    if head_dim is not None and (head_dim < 1 or out_features % head_dim):
        raise ValueError(f"head_dim {head_dim} does not divide out_features {out_features}")
    block = head_dim if head_dim is not None else min(block_rows, out_features)
    n_blocks = out_features // block if head_dim is not None else None
    if spec in ("start", "mid", "last") and single:
        return ({"start": 0, "mid": out_features // 2, "last": out_features - 1}[spec],)
    if spec in ("start", "mid", "last"):
        if n_blocks is not None:  # whole heads
            head = {"start": 0, "mid": n_blocks // 2, "last": n_blocks - 1}[spec]
            first = head * block
        else:
            first = {"start": 0, "mid": (out_features - block) // 2, "last": out_features - block}[spec]
        return tuple(range(first, first + block))
    if spec.startswith("random:"):
        n = int(spec.split(":", 1)[1])
        gen = seeded_generator(seed, salt, spec)
        if n_blocks is not None:
            n_heads = min(n_blocks, math.ceil(n / block))
            heads = sorted(torch.randperm(n_blocks, generator=gen)[:n_heads].tolist())
            return tuple(h * block + j for h in heads for j in range(block))
        return tuple(sorted(torch.randperm(out_features, generator=gen)[: min(n, out_features)].tolist()))
    rows = []
    for tok in spec.split(","):
        r = int(tok)
        if not -out_features <= r < out_features:
            raise ValueError(f"row {r} out of range for a weight with {out_features} rows")
        rows.append(r % out_features)
    return tuple(sorted(set(rows)))


def resolve_layers(
    layers: Sequence[int], n_layers: int, *, clamp: bool = False, notes: list[str] | None = None
) -> list[int]:
    """Non-negative layer indices, first occurrence order, duplicates dropped. Out of range: an error, or with
    `clamp` the nearest layer (0 or n_layers - 1) and a line in `notes`."""
    resolved: list[int] = []
    for layer in layers:
        if not -n_layers <= layer < n_layers:
            if not clamp:
                raise ValueError(f"layer {layer} out of range for a model with {n_layers} layers")
            near = 0 if layer < 0 else n_layers - 1
            if notes is not None:
                notes.append(f"layer {layer} is past the model's {n_layers} layers: probing layer {near} instead")
            layer = near
        if layer % n_layers not in resolved:
            resolved.append(layer % n_layers)
    return resolved


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    for path in ("model.layers", "model.model.layers", "base_model.model.model.layers", "transformer.h"):
        obj: object = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def _base_linear(mod: nn.Module) -> nn.Linear:
    # LoRA/PEFT wrap the original Linear as `base_layer`; the probe measures the base weight.
    while hasattr(mod, "base_layer"):
        mod = mod.base_layer
    if not isinstance(mod, nn.Linear):
        raise ValueError(f"probe target must be an nn.Linear, got {type(mod).__name__}")
    return mod


def _head_dim(model: nn.Module) -> int:
    cfg = model.config
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def build_targets(
    model: nn.Module,
    modules: Sequence[str] = ("k_proj", "down_proj"),
    layers: Sequence[int] = (0, -1),
    row_specs: Sequence[str] = ("random:32",),
    *,
    seed: int = 0,
    whole_kv_heads: bool = True,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    row_mode: str = "block",
    clamp_layers: bool = False,
    notes: list[str] | None = None,
) -> list[ProbeTarget]:
    """Targets for every (module, layer); `lm_head` once. Negative layers count from the end.

    row_mode "row": start/mid/last are single rows; "block": blocks (whole KV heads with `whole_kv_heads`).
    `clamp_layers`: an index past the depth probes the nearest layer, and a line saying so goes to `notes`."""
    if not modules:
        raise ValueError("modules must not be empty")
    if not row_specs:
        raise ValueError("row_specs must not be empty")
    decoder = _decoder_layers(model)
    resolved = resolve_layers(layers, len(decoder), clamp=clamp_layers, notes=notes)
    targets: list[ProbeTarget] = []
    seen: set[str] = set()
    for module in modules:
        if module not in MODULE_PATHS:
            raise ValueError(f"unknown module {module!r}; known: {', '.join(MODULE_PATHS)}")
        for layer in [None] if module == "lm_head" else resolved:
            if layer is None:
                linear = _base_linear(model.get_output_embeddings())
            else:
                linear = _base_linear(decoder[layer].get_submodule(MODULE_PATHS[module]))
            target = ProbeTarget(module=module, layer=layer, linear=linear)
            if target.name in seen:
                continue
            seen.add(target.name)
            single = row_mode == "row"
            head_dim = _head_dim(model) if (whole_kv_heads and module in KV_MODULES and not single) else None
            for spec in row_specs:
                rows = parse_row_spec(
                    spec,
                    linear.out_features,
                    head_dim=head_dim,
                    block_rows=block_rows,
                    seed=seed,
                    salt=target.name,
                    single=single,
                )
                target.row_sets.append(RowSet(spec=spec, rows=rows))
            targets.append(target)
    return targets


class _Capture:
    """Forward hooks that keep each target's input X and output Y (Y made a leaf if it has no graph)."""

    def __init__(self, targets: Sequence[ProbeTarget]):
        self.targets = list(targets)
        self.x: dict[str, Tensor] = {}
        self.y: dict[str, Tensor] = {}
        self.calls: dict[str, int] = {}
        self._handles: list = []

    def __enter__(self) -> _Capture:
        for t in self.targets:
            self._handles.append(t.linear.register_forward_hook(self._hook(t.name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(mod: nn.Module, inputs: tuple, out: Tensor) -> Tensor:
            self.calls[name] = self.calls.get(name, 0) + 1
            if not out.requires_grad:
                out = out.detach().requires_grad_(True)
            self.x[name] = inputs[0].detach()
            self.y[name] = out
            return out

        return hook


@dataclass
class GradResult:
    """Row gradients per target name: (K, n_rows, in) in `compute_dtype`, rows ordered as `target.rows`."""

    grads: dict[str, Tensor]
    logp: Tensor  # (K,) logp of each selected token at the temperature, detached
    method: str  # "vmap", "replicate" or "loop" (vmap fell back, or asked for)


METHODS = GRAD_METHODS


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward(
    model: nn.Module,
    ids: Tensor,
    attn: Tensor | None,
    b_idx: Tensor,
    t_idx: Tensor,
    targets: Sequence[ProbeTarget],
    temperature: float,
) -> tuple[_Capture, Tensor, torch.dtype]:
    """Forward with hooks; logp of token ids[b_k, t_k] (scored by the logits at t_k - 1), shape (K,).
    Only the logits that score selected tokens are computed (HF `logits_to_keep` with an index tensor)."""
    keep, col = torch.unique(t_idx - 1, return_inverse=True)
    with _Capture(targets) as cap, torch.enable_grad():
        out = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep, use_cache=False)
        logits = out.logits[b_idx, col]  # (K, V)
        cdt = _compute_dtype(logits.dtype)
        logq = torch.log_softmax(logits.to(cdt) / temperature, dim=-1)
        logp = logq.gather(-1, ids[b_idx, t_idx].unsqueeze(-1)).squeeze(-1)
    for t in targets:
        if cap.calls.get(t.name, 0) != 1:
            raise RuntimeError(f"hook on {t.name} fired {cap.calls.get(t.name, 0)} times in one forward")
    return cap, logp, cdt


def _contract(g: Tensor, x: Tensor, rows: Tensor, cdt: torch.dtype, mask: Tensor | None) -> Tensor:
    """sum_p g[k, p, rows] x[k, p, :] -> (k, R, in); padded positions of x zeroed first."""
    x = x.to(cdt)
    if mask is not None and x.shape[1] == mask.shape[1]:  # lm_head's x has only the kept columns
        x = x * mask.unsqueeze(-1).to(cdt)
    return torch.einsum("kpr,kpi->kri", g[..., rows].to(cdt), x)


def exact_row_grads(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    positions: Sequence[tuple[int, int]],
    targets: Sequence[ProbeTarget],
    *,
    temperature: float = 1.0,
    chunk_size: int = 16,
    method: str = "vmap",
) -> GradResult:
    """Exact d logp(input_ids[b, t]) / d W[rows, :] for every (b, t) in `positions`.

    `input_ids`/`attention_mask` are a right-padded batch (B, L). Position t >= 1 is the index of the
    scored token; it is predicted by the logits at t - 1. Gradients are exact sums over all positions
    p <= t (module docstring); padding is cut off or comes after every real token, so it never contributes.

    Methods (all exact; the parity test checks each against one full backward per position):
    - "vmap" (§4.2): one forward per trajectory, then one `is_grads_batched` backward for up to
      `chunk_size` of its positions; falls back to "loop" if a kernel has no vmap batching rule.
    - "replicate": one row per position, cut after its token, `chunk_size` rows per forward, and a single
      ordinary backward of sum_k logp_k. Rows are independent, so each row's output gradient is exactly its
      own position's. No vmap at all (works with any attention kernel); more forward FLOPs, fewer
      backward FLOPs, bigger matmuls: the fastest on CPU for short sequences.
    - "loop": one forward per trajectory, one backward per position with `retain_graph`.
    """
    if not positions:
        raise ValueError("positions must not be empty")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        raise ValueError("disable gradient checkpointing for the probe: recomputation fires hooks twice")
    lengths = attention_mask.sum(-1).tolist()
    for b, t in positions:
        if not 1 <= t < lengths[b]:
            raise ValueError(f"position (row {b}, t {t}) outside 1 <= t < {lengths[b]} (the row's length)")
    if method == "replicate":
        return _replicate(model, input_ids, positions, targets, temperature, chunk_size)
    names = [t.name for t in targets]
    grads: dict[str, list[Tensor | None]] = {n: [None] * len(positions) for n in names}
    logps: list[Tensor | None] = [None] * len(positions)
    used = method
    by_row: dict[int, list[int]] = {}
    for j, (b, _) in enumerate(positions):
        by_row.setdefault(b, []).append(j)
    for b, js in by_row.items():
        js = sorted(js, key=lambda j: positions[j][1])
        for start in range(0, len(js), chunk_size):
            chunk = js[start : start + chunk_size]
            # this trajectory alone, cut after the chunk's last scored token: later tokens (and padding)
            # cannot influence an earlier logp under causal attention
            ids = input_ids[b : b + 1, : positions[chunk[-1]][1] + 1]
            t_idx = torch.tensor([positions[j][1] for j in chunk], device=ids.device)
            cap, logp, cdt = _forward(model, ids, None, torch.zeros_like(t_idx), t_idx, targets, temperature)
            ys = [cap.y[n] for n in names]
            gys = None
            if used == "vmap":
                eye = torch.eye(len(chunk), dtype=logp.dtype, device=ids.device)
                try:
                    gys = torch.autograd.grad(logp, ys, grad_outputs=eye, is_grads_batched=True, allow_unused=True)
                except RuntimeError:
                    used = "loop"  # no vmap batching rule for some kernel: exact, but K backwards
                    cap, logp, cdt = _forward(model, ids, None, torch.zeros_like(t_idx), t_idx, targets, temperature)
                    ys = [cap.y[n] for n in names]
            if gys is None:
                per = [
                    torch.autograd.grad(logp[q], ys, retain_graph=q < len(chunk) - 1, allow_unused=True)
                    for q in range(len(chunk))
                ]
                gys = tuple(
                    torch.stack([p[i] if p[i] is not None else torch.zeros_like(ys[i]) for p in per])
                    for i in range(len(ys))
                )
            for i, t in enumerate(targets):
                g = gys[i] if gys[i] is not None else torch.zeros((len(chunk), *ys[i].shape), dtype=ys[i].dtype,
                                                                   device=ids.device)  # fmt: skip
                x = cap.x[t.name].expand(len(chunk), *cap.x[t.name].shape[1:])
                rows = torch.tensor(t.rows, device=ids.device)
                out = _contract(g[:, 0], x, rows, cdt, None)
                for q, j in enumerate(chunk):
                    grads[t.name][j] = out[q]
            for q, j in enumerate(chunk):
                logps[j] = logp[q].detach()
    return GradResult(grads={n: torch.stack(v) for n, v in grads.items()}, logp=torch.stack(logps), method=used)


def _replicate(
    model: nn.Module,
    input_ids: Tensor,
    positions: Sequence[tuple[int, int]],
    targets: Sequence[ProbeTarget],
    temperature: float,
    chunk_size: int,
) -> GradResult:
    device = input_ids.device
    names = [t.name for t in targets]
    grads: dict[str, list[Tensor]] = {n: [] for n in names}
    logps: list[Tensor] = []
    for start in range(0, len(positions), chunk_size):
        chunk = positions[start : start + chunk_size]
        width = max(t for _, t in chunk) + 1
        ids = torch.zeros((len(chunk), width), dtype=torch.long, device=device)
        attn = torch.zeros((len(chunk), width), dtype=torch.long, device=device)
        for r, (b, t) in enumerate(chunk):  # right padding: real tokens first, so pads never reach them
            ids[r, : t + 1] = input_ids[b, : t + 1]
            attn[r, : t + 1] = 1
        t_idx = torch.tensor([t for _, t in chunk], device=device)
        ar = torch.arange(len(chunk), device=device)
        cap, logp, cdt = _forward(model, ids, attn, ar, t_idx, targets, temperature)
        gys = torch.autograd.grad(logp.sum(), [cap.y[n] for n in names], allow_unused=True)
        for t, g in zip(targets, gys, strict=True):
            y = cap.y[t.name]
            g = g if g is not None else torch.zeros_like(y)
            grads[t.name].append(_contract(g, cap.x[t.name], torch.tensor(t.rows, device=device), cdt, attn))
        logps.append(logp.detach())
    return GradResult(grads={n: torch.cat(v) for n, v in grads.items()}, logp=torch.cat(logps), method="replicate")


def reference_row_grads(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    positions: Sequence[tuple[int, int]],
    targets: Sequence[ProbeTarget],
    *,
    temperature: float = 1.0,
) -> dict[str, Tensor]:
    """The slow, obviously correct reference: full-weight autograd, one backward per position.

    One forward per trajectory (batch row), then `autograd.grad(logp_t, W)` per selected position.
    Used by the parity test and the benchmark.
    """
    weights = [t.linear.weight for t in targets]
    saved = [w.requires_grad for w in weights]
    out: dict[str, list[Tensor]] = {t.name: [] for t in targets}
    try:
        for w in weights:
            w.requires_grad_(True)
        by_row: dict[int, list[int]] = {}
        for j, (b, _) in enumerate(positions):
            by_row.setdefault(b, []).append(j)
        results: dict[int, list[Tensor]] = {}
        for b, js in by_row.items():
            n = int(attention_mask[b].sum())
            ids = input_ids[b : b + 1, :n]
            with torch.enable_grad():
                logits = model(input_ids=ids, use_cache=False).logits[0]
                cdt = _compute_dtype(logits.dtype)
                logq = torch.log_softmax(logits.to(cdt) / temperature, dim=-1)
                for j in js:
                    t = positions[j][1]
                    gs = torch.autograd.grad(logq[t - 1, ids[0, t]], weights, retain_graph=True)
                    results[j] = [g.to(cdt) for g in gs]
        for j in range(len(positions)):
            for t, g in zip(targets, results[j], strict=True):
                out[t.name].append(g[t.rows])
    finally:
        for w, s in zip(weights, saved, strict=True):
            w.requires_grad_(s)
    return {n: torch.stack(v) for n, v in out.items()}
