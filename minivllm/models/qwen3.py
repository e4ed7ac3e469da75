"""Qwen3 decoder-only transformer (Qwen team, 2025, "Qwen3 Technical Report").

Per layer: ``x = x + Attn(RMSNorm(x))``; ``x = x + MLP(RMSNorm(x))``, where attention is
grouped-query attention with RoPE and a per-head RMSNorm on q and k (before RoPE), and the
MLP is SwiGLU ``down(silu(gate(x)) * up(x))``. Parameter names match the Hugging Face
checkpoint after packing (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``), see
:attr:`Qwen3ForCausalLM.packed_modules_mapping`.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from minivllm.distributed import get_tp_size
from minivllm.layers.activation import SiluAndMul
from minivllm.layers.attention.context import ForwardContext
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.models.hf_config import get_head_dim, get_rope_theta


class Qwen3Attention(nn.Module):
    """``hidden [T, H] -> [T, H]``; this rank holds ``num_heads / tp`` query heads and
    ``num_kv_heads / tp`` kv heads."""

    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        tp = get_tp_size()
        self.head_dim = get_head_dim(config)
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = config.num_key_value_heads
        if self.total_num_heads % self.total_num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({self.total_num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.total_num_kv_heads})")
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads,
                                          bias=bool(getattr(config, "attention_bias", False)))
        self.num_heads = self.total_num_heads // tp
        self.num_kv_heads = self.total_num_kv_heads // tp
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, config.hidden_size,
                                        bias=bool(getattr(config, "attention_bias", False)))
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary = rotary  # one instance shared by all layers (holds no parameters)
        self.scale = self.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        qk = self._fused_qk_norm_rope(positions, q, k)
        if qk is None:
            q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
        else:
            q, k = qk
        k_cache, v_cache = kv_cache
        o = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))

    def _fused_qk_norm_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q_norm, k_norm and the rotary embedding as one C call on a CPU (``CpuFusedOps.qk_norm_rope``)
        when the three modules have the C ops and nothing watches them: a forward hook on any of
        them (chapter 02 hooks q_norm) keeps the module calls, so the hook fires. ``None``: run them."""
        norm_q, norm_k, rotary = self.q_norm, self.k_norm, self.rotary
        ops = norm_q.fused
        if ops is None or norm_k.fused is None or rotary.fused is None or _hooked(norm_q, norm_k, rotary):
            return None
        return ops.qk_norm_rope(q, k, norm_q.weight, norm_q.eps, norm_k.weight, norm_k.eps, positions,
                                rotary.cos_sin_cache(q.device))


def _hooked(*modules: nn.Module) -> bool:
    """Whether a forward (pre-)hook would run on any of ``modules`` when called, global hooks included."""
    if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


class Qwen3MLP(nn.Module):
    """SwiGLU MLP: ``[T, H] -> [T, H]`` with the intermediate size split across ranks."""

    def __init__(self, config):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (Qwen3 uses 'silu')")
        i = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [i, i], bias=False)
        self.down_proj = RowParallelLinear(i, config.hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    """One pre-norm transformer block. The residual stream is carried separately so each
    residual add is fused into the following RMSNorm (``RMSNorm.forward(x, residual)``)."""

    def __init__(self, config, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, ctx):
        """Returns ``(mlp_out, residual)``; the residual add is fused into the next norm."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and final norm: ``input_ids [T] -> hidden [T, hidden_size]``."""

    def __init__(self, config):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(get_head_dim(config), config.max_position_embeddings, get_rope_theta(config))
        self.rotary = rotary
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        if len(ctx.kv_caches) != len(self.layers):
            raise ValueError(f"ctx.kv_caches has {len(ctx.kv_caches)} entries, the model has "
                             f"{len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, ctx.kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 with its LM head.

    Usage by the model runner::

        hidden = model(input_ids, positions, ctx)        # [T, hidden_size]
        logits = model.compute_logits(hidden[logits_indices])  # fp32 [N, vocab_size]

    Args:
        config: a Hugging Face ``Qwen3Config`` (or compatible object). Parameters are
            allocated in torch's current default dtype/device; the loader fills them.
    """

    #: checkpoint module name -> (our packed module name, shard id passed to its weight_loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids`` int64 ``[T]``, ``positions`` int64 ``[T]`` (absolute) -> final-norm
        hidden states ``[T, hidden_size]``. Layer ``i`` reads and writes ``ctx.kv_caches[i]``."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size] -> fp32 logits [N, vocab_size]``, full on every tp rank."""
        return self.lm_head.compute_logits(hidden)

    def compute_logits_and_greedy(self, hidden: torch.Tensor):
        """``(logits, greedy ids or None)``: ``ParallelLMHead.compute_logits_and_greedy``, unless
        :meth:`compute_logits` was replaced (a notebook's tracer, on the model or its class): then
        ``(compute_logits(hidden), None)``, so the replacement still sees every step."""
        if getattr(self.compute_logits, "__func__", None) is not _STOCK_COMPUTE_LOGITS:
            return self.compute_logits(hidden), None
        return self.lm_head.compute_logits_and_greedy(hidden)


_STOCK_COMPUTE_LOGITS = Qwen3ForCausalLM.compute_logits  # compute_logits_and_greedy defers to a replacement
