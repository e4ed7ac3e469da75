"""Reusable helpers for the model-side tests (random HF checkpoints, hand-built metadata)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from minivllm.layers.attention.context import ForwardContext
from minivllm.layers.attention.metadata import AttentionMetadata
from minivllm.layers.attention.torch_backend import TorchAttentionBackend
from minivllm.models.registry import get_model_class
from minivllm.utils import cdiv
from minivllm.utils.loader import init_random_weights, load_weights
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

# A tiny Qwen3 whose head_dim (16) differs from hidden / heads (48 / 4 = 12), GQA 4:2.
SMALL_QWEN3 = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def make_hf_checkpoint(tmp_path, seed: int = 0, shards: int = 1, **config_overrides) -> Path:
    """Build a small random Hugging Face ``Qwen3ForCausalLM`` (fp32) and save it with safetensors.

    Every weight (including the q/k norms and layer norms, which HF initialises to ones)
    is drawn at random from ``seed``, so a wrong norm or a swapped tensor shows up. With
    ``shards=2`` the tensors are split over two files plus ``model.safetensors.index.json``.

    Returns the checkpoint directory.
    """
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(SMALL_QWEN3)
    cfg.update(config_overrides)
    rope_theta = cfg.pop("rope_theta")
    config = Qwen3Config(**cfg, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    out = Path(tmp_path) / f"qwen3-seed{seed}-shards{shards}"
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a checkpoint ships its tokenizer (here the embedded one's)
        shutil.copy(EMBEDDED_MODEL_DIR / name, out / name)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if shards == 1:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(state)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: state[n] for n in names[s::shards]}
            save_file(part, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return out


def load_hf_model(path):
    """The saved checkpoint as a Hugging Face model in fp32, eval mode."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def allocate_block_tables(total_lens: list[int], block_size: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    """Give each sequence enough distinct physical blocks for ``total_lens[i]`` tokens,
    drawn in shuffled order from ``num_blocks`` (so paging is not accidentally contiguous)."""
    need = [cdiv(n, block_size) for n in total_lens]
    if sum(need) > num_blocks:
        raise ValueError(f"need {sum(need)} blocks, only {num_blocks}")
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables, pos = [], 0
    for n in need:
        tables.append(pool[pos:pos + n])
        pos += n
    return tables


def build_metadata(seqs: list[tuple[int, int]], block_size: int, block_tables: list[list[int]],
                   device="cpu", num_pad_tokens: int = 0) -> AttentionMetadata:
    """An ``AttentionMetadata`` for sequences given as ``(num_cached, num_new)``.

    Sequence ``i`` has ``num_cached`` tokens already in the cache and ``num_new`` query
    tokens this step (positions ``num_cached .. num_cached + num_new - 1``), whose slots
    come from ``block_tables[i]``. ``num_pad_tokens`` extra tokens with slot -1 are
    appended (padding, as for CUDA graphs).
    """
    q_lens = [n for _, n in seqs]
    ctx_lens = [c + n for c, n in seqs]
    slots = []
    for (c, n), table in zip(seqs, block_tables):
        for p in range(c, c + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
    slots += [-1] * num_pad_tokens
    width = max(len(t) for t in block_tables)
    bt = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + ctx_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        cu_seqlens_q=cu_q.to(device),
        cu_seqlens_k=cu_k.to(device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=bt.to(device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(ctx_lens),
        block_size=block_size,
        is_decode_only=all(n == 1 for n in q_lens),
        q_lens_cpu=q_lens,
        context_lens_cpu=ctx_lens,
    )


class PagedRunner:
    """A minimal stand-in for the engine's model runner: a KV pool and one step at a time."""

    NUM_BLOCKS = 48
    BLOCK_SIZE = 4

    def __init__(self, path, random_seed: int | None = None):
        """Load the checkpoint at ``path`` (or, with ``random_seed``, only its config and
        random weights)."""
        from transformers import AutoConfig  # imported late: slow, and only needed here

        config = AutoConfig.from_pretrained(path)
        self.model = get_model_class(config)(config).eval()
        if random_seed is None:
            load_weights(self.model, path)
        else:
            init_random_weights(self.model, random_seed)
        m = self.model
        shape = (self.NUM_BLOCKS, self.BLOCK_SIZE, m.num_kv_heads_per_rank, m.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(m.num_layers)]
        self.backend = TorchAttentionBackend()

    @torch.no_grad()
    def step(self, tokens_per_seq: list[list[int]], cached: list[int], tables: list[list[int]]):
        """Run the new tokens of each sequence (after ``cached`` tokens); returns one logits
        tensor ``[num_new, vocab]`` per sequence."""
        seqs = [(c, len(t)) for c, t in zip(cached, tokens_per_seq)]
        meta = build_metadata(seqs, self.BLOCK_SIZE, tables)
        ids = torch.tensor([x for t in tokens_per_seq for x in t], dtype=torch.int64)
        pos = torch.tensor([c + i for c, t in zip(cached, tokens_per_seq) for i in range(len(t))], dtype=torch.int64)
        ctx = ForwardContext(meta=meta, backend=self.backend, kv_caches=self.kv)
        logits = self.model.compute_logits(self.model(ids, pos, ctx))
        assert logits.dtype == torch.float32
        return list(logits.split([len(t) for t in tokens_per_seq]))


def set_generation_eos(checkpoint: Path, eos_id: int) -> Path:
    """Write ``checkpoint``'s generation_config.json with ``eos_id`` as its end-of-sequence id."""
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    return checkpoint
