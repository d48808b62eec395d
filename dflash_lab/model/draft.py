"""The DFlash draft: Qwen3-style decoder layers that denoise a block of MASK tokens given target hidden states.

Architecture (one definition, used by both training and decoding):
    context = RMSNorm(W_fc [h_l1 ; h_l2 ; ...])      target hidden states at ``target_layer_ids``, concatenated,
                                                      projected (linear, no bias) and RMS-normalised
    x_0     = target embedding of the block tokens   (anchor token, then MASK x (block_size - 1))
    layer:  x = x + Attn(RMSNorm(x), context);  x = x + SwiGLU(RMSNorm(x))
    Attn:   queries from the block tokens only; keys/values from [context ; block]; RoPE at absolute
            (document-relative) positions; q/k RMSNorm per head; grouped-query attention (native, no copies);
            which keys a block token sees is a ``KeyIntervals`` (dflash_lab.model.attention: flex_attention
            BlockMask on GPU, exact per-document attention for CPU training)
    output  = RMSNorm(x_L), read out by the target's (frozen) LM head
The draft owns no embedding and no LM head: ``DFlashModel`` passes the target's.
RMSNorm normalises in float32 and returns the input's dtype (bf16 activations under autocast), as the reference
DFlash draft (Qwen3RMSNorm on a bf16 model) does. ``activation_checkpointing`` recomputes each layer in the
backward pass instead of storing its activations.

Compiled layers (``compile_layers``: True, False or ``"auto"`` = on CUDA only): RMSNorm, the rotary embedding and
the SwiGLU MLP (its three matmuls with the silu product between them) run through ``torch.compile`` (fullgraph:
no graph breaks), which fuses their pointwise work into a few kernels instead of one kernel (and one saved
tensor) per elementwise op; attention is compiled separately (flex_attention, dflash_lab.model.attention).
Each piece sees one layout whatever the batch: norms and the MLP take [tokens, features] (the token count
marked dynamic), rope [rows, heads, length, d] (rows and length dynamic), so a process compiles a bounded set of
graphs per piece (grad / no-grad mode, inputs with / without grad, size-1 dimensions specialised) and then never
recompiles per step. Compiling costs ~20 s per graph on a slow CPU, hence off on CPU under ``"auto"``. What a
compiled piece saves for backward is AOTAutograd's choice (at most what the eager ops save).

Cost per layer: O(Q * C * hidden) attention for Q block tokens that each see C context keys (C = the anchor's
offset in its document, + bs) + O(Q * hidden * intermediate) MLP + O(T * hidden * kv_dim) context keys/values;
the context projection is O(T * n_layers_used * hidden^2).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_lab.model.attention import KeyIntervals, attend


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the draft: one per draft layer.

    Rule: one draft layer -> the middle layer ``L // 2``; n > 1 layers -> evenly spaced from layer 1 to L - 3.

    Raises:
        ValueError: the target is too shallow for n evenly spaced layers (set ``model.target_layer_ids``).

    Example:
        >>> default_target_layer_ids(36, 5)
        [1, 9, 17, 25, 33]
        >>> default_target_layer_ids(4, 1)
        [2]
    """
    if num_draft_layers < 1:
        raise ValueError(f"model.draft_layers={num_draft_layers}: the draft needs at least one layer")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end <= start:
        raise ValueError(
            f"a {num_target_layers}-layer target has no room for {num_draft_layers} evenly spaced layers in "
            f"[1, L-3]: set model.target_layer_ids explicitly or use model.draft_layers=1"
        )
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DraftConfig:
    """Shape of the draft; hidden_size must equal the target's (shared embedding and LM head)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: list[int] = field(default_factory=list)
    target_hidden_size: int | None = None     # None: same as hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    def __post_init__(self) -> None:
        if not self.target_layer_ids:
            raise ValueError("DraftConfig.target_layer_ids is empty: give one target layer id per feature")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    def to_dict(self) -> dict:
        """Plain dict (checkpoints, run config)."""
        return asdict(self)



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised over the last dimension in float32, scaled by ``weight``, returned in ``x``'s dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * x.to(dtype)   # float32 weights x bf16 would promote to float32


def swiglu_mlp(h: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
               down_weight: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(h)) * up(h)), bias-free."""
    return F.linear(F.silu(F.linear(h, gate_weight)) * F.linear(h, up_weight), down_weight)


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm then rotary embedding of ``x`` [tokens, heads, d] with cos/sin [tokens, 1, d]."""
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


# One function (one code object) per role of a compiled piece. Dynamo keeps its compiled graphs, and counts them
# against ``recompile_limit`` (8), per code object: roles that shared ``rms_norm`` (hidden-size norms, head-dim
# norms) added up their graphs until a run hit the limit at its first decode. Within a role a graph is keyed by
# dtype and by whether the input requires grad (the first layer's input, the frozen embeddings, does not).
def _hidden_norm(x, weight, eps):
    return rms_norm(x, weight, eps)


def _qk_norm_rope(x, weight, eps, cos, sin):
    return head_norm_rope(x, weight, eps, cos, sin)


def _mlp(h, gate_weight, up_weight, down_weight):
    return swiglu_mlp(h, gate_weight, up_weight, down_weight)


@functools.cache
def _compiled(fn):
    # dynamic=None: only the dimensions marked dynamic at the call are symbolic (hidden sizes stay static)
    return torch.compile(fn, fullgraph=True)


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[..., features] -> [tokens, features] with the token count dynamic for the compiler."""
    flat = x.reshape(-1, x.shape[-1])
    torch._dynamo.maybe_mark_dynamic(flat, 0)
    return flat


_EAGER_AFTER_LIMIT: set[str] = set()   # roles that hit dynamo's recompile limit: eager from then on (warned once)


def _is_recompile_limit(error: BaseException) -> bool:
    """dynamo's refusal to compile a function again (the class name differs across torch versions). torch._dynamo is
    looked up here, not at import: importing it costs a process ~1.5 s that an eager run never needs."""
    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
    return isinstance(error, tuple(getattr(torch._dynamo.exc, n) for n in names if hasattr(torch._dynamo.exc, n)))


def _run(role, *args):
    """``role`` compiled; eager (with one warning) for the rest of the process if dynamo refuses to compile it
    again: a recompile limit must cost speed, never a multi-day run."""
    if role.__name__ not in _EAGER_AFTER_LIMIT:
        try:
            return _compiled(role)(*args)
        except Exception as error:
            if not _is_recompile_limit(error):
                raise
            _EAGER_AFTER_LIMIT.add(role.__name__)
            warnings.warn(f"compiled draft piece {role.__name__} hit torch._dynamo's recompile limit ({error}); "
                          f"it runs eager from now on (model.compile_layers)", RuntimeWarning, stacklevel=3)
    return role(*args)


@dataclass(frozen=True)
class LayerOps:
    """The draft's pointwise pieces, eager or compiled (see the module docstring); layers take one as an argument.

    Compiled pieces run only where gradients are being recorded (the training forward): no-grad passes (fixed
    anchors, probes, decoding) run eager, so evaluation compiles nothing and adds no graphs. Under a Python
    dispatch mode (FlopCounterMode, memory trackers) the pieces run eager too: such modes do not compose with
    compiled graphs (as with flex_attention in dflash_lab.model.attention).
    """

    compiled: bool

    def _use_compiled(self) -> bool:
        return self.compiled and torch.is_grad_enabled() and not torch._C._len_torch_dispatch_stack()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """A hidden-size norm (input, post-attention, context and final norms)."""
        if not self._use_compiled():
            return rms_norm(x, weight, eps)
        return _run(_hidden_norm, _tokens_first(x), weight, eps).view(x.shape)

    def head_norm_rope(self, x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
        """q or k [R, L, heads, d]: per-head norm, then rope with cos/sin [R, L, d]."""
        rows, length, heads, dim = x.shape
        if not self._use_compiled():
            return head_norm_rope(x, weight, eps, cos[:, :, None], sin[:, :, None])
        # tokens first ([R L, heads, d], tables [R L, 1, d]): one layout whatever the rows, so a batch of one row
        # (a size-1 dimension, which the compiler specialises) needs no graph of its own
        flat, cos, sin = x.reshape(-1, heads, dim), cos.reshape(-1, 1, dim), sin.reshape(-1, 1, dim)
        for tensor in (flat, cos, sin):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return _run(_qk_norm_rope, flat, weight, eps, cos, sin).view(x.shape)

    def mlp(self, h: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
            down_weight: torch.Tensor) -> torch.Tensor:
        if not self._use_compiled():
            return swiglu_mlp(h, gate_weight, up_weight, down_weight)
        out = _run(_mlp, _tokens_first(h), gate_weight, up_weight, down_weight)
        return out.view(*h.shape[:-1], out.shape[-1])


EAGER = LayerOps(compiled=False)


def check_compile_layers(compile_layers) -> bool | str:
    """``compile_layers`` if it is True, False or ``"auto"``, else ValueError."""
    if not (isinstance(compile_layers, bool) or compile_layers == "auto"):
        raise ValueError(f"model.compile_layers={compile_layers!r}: choose true, false or auto")
    return compile_layers


def compiles_layers(compile_layers: bool | str, device_type: str) -> bool:
    """Whether a ``compile_layers`` setting compiles the draft's pieces on ``device_type`` (``"auto"``: on CUDA
    only): the one rule, read by the draft and by the memory model (``dflash_lab.model.footprint``)."""
    return compile_layers is True or (compile_layers == "auto" and device_type == "cuda")


def layer_ops(compile_layers: bool | str, device: torch.device) -> LayerOps:
    """The pieces for a ``compile_layers`` setting on ``device`` (``"auto"``: compiled on CUDA only)."""
    return LayerOps(compiled=compiles_layers(compile_layers, device.type))


def _autocast_dtype(device_type: str) -> torch.dtype:
    if hasattr(torch, "get_autocast_dtype"):   # torch >= 2.4
        return torch.get_autocast_dtype(device_type)
    return torch.get_autocast_gpu_dtype() if device_type == "cuda" else torch.get_autocast_cpu_dtype()


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale: normalised in float32, returned in the input's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: LayerOps = EAGER) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def with_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops: LayerOps = EAGER) -> torch.Tensor:
        """A per-head norm (q/k norm) of ``x`` [R, L, heads, d], then rope with cos/sin [R, L, d]."""
        return ops.head_norm_rope(x, self.weight, self.eps, cos, sin)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [..., L, head_dim] for integer ``positions`` [..., L] (rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., d] by cos/sin tables that broadcast to it (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    """Queries from the block, keys/values from [context ; block]; GQA; q/k norm; RoPE."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, context, rope_q, rope_kv, attention: KeyIntervals | None, ops: LayerOps = EAGER):
        rows, q_len, _ = x.shape
        d = self.cfg.head_dim
        kv_in = torch.cat([context, x], dim=1)
        q = self.q_norm.with_rope(self.q_proj(x).view(rows, q_len, -1, d), *rope_q, ops).transpose(1, 2)
        k = self.k_norm.with_rope(self.k_proj(kv_in).view(rows, kv_in.shape[1], -1, d), *rope_kv, ops)
        k = k.transpose(1, 2)
        v = self.v_proj(kv_in).view(rows, kv_in.shape[1], -1, d).transpose(1, 2)
        # d ** -0.5 exactly as the HF target computes it: compiled flex guards on the scale's value
        out = attend(q, k, v, attention, scale=d ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(rows, q_len, -1))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer: attention over [context ; block], then a SwiGLU MLP."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, context, rope_q, rope_kv, attention: KeyIntervals | None, ops: LayerOps = EAGER):
        x = x + self.self_attn(self.input_layernorm(x, ops), context, rope_q, rope_kv, attention, ops)
        h = self.post_attention_layernorm(x, ops)
        return x + ops.mlp(h, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class DFlashDraft(nn.Module):
    """The trainable draft network (no embedding, no LM head).

    Args:
        cfg: shapes and target layer ids.
        init_seed: seed of the weight initialisation: the untrained baseline is reproducible.
        init_std: std of the linear weights; None: hidden_size ** -0.5 (0.016 at hidden 4096, about the 0.02
            DFlash uses at that size; 0.125 at hidden 64, where 0.02 would leave the draft's contributions ten
            times smaller than the target embeddings it adds to, and learning stalls at the unigram).
        activation_checkpointing: recompute each layer in the backward pass (memory ~ one layer's activations
            instead of all layers', for one more forward of the layers).
        compile_layers: run RMSNorm, rope and the MLP through torch.compile: True, False or ``"auto"`` (on CUDA
            only; resolved per call from the inputs' device). See the module docstring.
    """

    def __init__(self, cfg: DraftConfig, init_seed: int = 0, init_std: float | None = None,
                 activation_checkpointing: bool = False, compile_layers: bool | str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = bool(activation_checkpointing)
        self.compile_layers = check_compile_layers(compile_layers)
        in_features = len(cfg.target_layer_ids) * (cfg.target_hidden_size or cfg.hidden_size)
        self.fc = nn.Linear(in_features, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.init_std = float(init_std) if init_std is not None else cfg.hidden_size ** -0.5
        self.reset_parameters(init_seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init: linear weights ~ N(0, init_std^2) from a private generator; norms = 1."""
        generator = torch.Generator().manual_seed(int(seed))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                weight = torch.empty(module.weight.shape).normal_(0.0, self.init_std, generator=generator)
                module.weight.copy_(weight)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def _compute_dtype(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast: the autocast dtype, so the residual stream has one dtype from layer 0 on (float32
        # embeddings of a float32 target would otherwise keep it in float32 and give every compiled norm a second
        # graph); without autocast, inputs follow the draft's weights (a bf16 target feeding a float32 draft on
        # GPU would otherwise fail in the matmul).
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            return x.to(_autocast_dtype(device_type))
        return x.to(self.fc.weight.dtype)

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """[R, T, n_layers * H_target] target features -> [R, T, H] normalised draft context."""
        ops = layer_ops(self.compile_layers, target_features.device)
        return self.hidden_norm(self.fc(self._compute_dtype(target_features)), ops)

    def forward(self, context: torch.Tensor, context_positions: torch.Tensor, block_embeds: torch.Tensor,
                block_positions: torch.Tensor, attention: KeyIntervals | None) -> torch.Tensor:
        """Hidden states of the block tokens.

        Args:
            context: [R, T, H] projected context (``project_context``).
            context_positions: Long[R, T] positions of the context tokens.
            block_embeds: [R, Q, H] target embeddings of the block tokens.
            block_positions: Long[R, Q] positions of the block tokens.
            attention: the keys each block token sees (keys = [context ; block tokens]), or None (everything
                visible: decoding one block).

        Returns:
            [R, Q, H] final-normed hidden states (apply the target LM head for logits).
        """
        block_embeds = self._compute_dtype(block_embeds)
        dtype = block_embeds.dtype
        cfg = self.cfg
        rope_q = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta, dtype)
        key_positions = torch.cat([context_positions, block_positions], dim=1)
        rope_kv = rope_cos_sin(key_positions, cfg.head_dim, cfg.rope_theta, dtype)
        context = context.to(dtype)
        ops = layer_ops(self.compile_layers, block_embeds.device)
        x = block_embeds
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, context, rope_q, rope_kv, attention, ops, use_reentrant=False)
            else:
                x = layer(x, context, rope_q, rope_kv, attention, ops)
        return self.norm(x, ops)
