"""Draft-model training helpers for ``train_tiny_model.py --distill-from DIR`` (``minivllm-tiny-draft``).

A draft model for speculative decoding is useful in proportion to how often it proposes what the
target would produce, so it is trained on the target's next-token distributions (knowledge
distillation: soft cross-entropy against the teacher's softmax) rather than on the data alone.
The held-out report adds what matters for speculation: how often the draft's argmax equals the
teacher's on the held-out stream (the greedy acceptance rate of a one-token draft, roughly).

``splice`` keeps the draft's section of ``docs/tiny_model.md`` separate from the main model's,
so either can be re-rendered without losing the other.
"""
from __future__ import annotations

from pathlib import Path

DRAFT_MARKER = "<!-- draft model section: rendered by scripts/train_tiny_model.py --distill-from -->"


def _windows(ids, seq_len: int, batch: int):
    """The held-out stream in ``evaluate``'s layout: groups of windows of seq_len + 1 tokens."""
    import torch

    data = torch.tensor(ids, dtype=torch.long)
    n_full = (len(data) - 1) // seq_len
    windows = [data[i * seq_len: i * seq_len + seq_len + 1] for i in range(n_full)]
    return [torch.stack(windows[i: i + batch]) for i in range(0, len(windows), batch)]


class Distiller:
    """The teacher (loaded from ``teacher_dir`` in fp32, frozen), its held-out argmax once, and the loss.

    Raises:
        ValueError: the teacher's vocabulary is not ``vocab_size``.
    """

    def __init__(self, teacher_dir: str, held_ids: list[int], T: int, vocab_size: int, batch: int = 8):
        import torch
        from transformers import Qwen3ForCausalLM

        self.teacher = Qwen3ForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        if self.teacher.config.vocab_size != vocab_size:
            raise ValueError(f"--distill-from {teacher_dir}: vocab {self.teacher.config.vocab_size}, "
                             f"the draft's is {vocab_size}")
        self.groups = _windows(held_ids, T, batch)
        self.teacher_top1, total, count = [], 0.0, 0
        with torch.no_grad():
            for x in self.groups:
                logits = self.teacher(input_ids=x[:, :-1]).logits
                self.teacher_top1.append(logits.argmax(-1))
                total += torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
                count += x[:, 1:].numel()
        self.teacher_heldout_loss = total / count

    def loss(self, student_logits, input_ids):
        """Soft cross-entropy ``-sum_v p_teacher(v) log p_student(v)``, mean over positions
        (KL(teacher || student) plus the teacher's entropy, a constant)."""
        import torch

        with torch.no_grad():
            target = torch.softmax(self.teacher(input_ids=input_ids).logits.float(), dim=-1)
        logp = torch.log_softmax(student_logits.float(), dim=-1)
        return -(target * logp).sum(-1).mean()

    def agreement(self, model) -> float:
        """Fraction of held-out positions (full windows) where the student's argmax is the teacher's."""
        import torch

        same = count = 0
        model.eval()
        with torch.no_grad():
            for x, top1 in zip(self.groups, self.teacher_top1):
                same += int((model(input_ids=x[:, :-1]).logits.argmax(-1) == top1).sum())
                count += top1.numel()
        model.train()
        return round(same / count, 4)

    def record(self, model, teacher_dir: str) -> dict:
        return {"teacher": Path(teacher_dir).name,
                "loss": "soft cross-entropy against the teacher's softmax (temperature 1), every position",
                "teacher_heldout_loss": round(self.teacher_heldout_loss, 4),
                "heldout_teacher_top1_agreement": self.agreement(model)}


def mark_draft_config(out: Path, k: int) -> None:
    """Name the draft's default ``num_speculative_tokens`` in its config.json (vLLM's rule: a
    ``speculative_config`` without that key takes the draft model config's)."""
    import json

    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg["num_speculative_tokens"] = k
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def render_section(r: dict) -> str:
    """The draft model's section of docs/tiny_model.md, from its training record."""
    c, h, m, d = r["corpus"], r["hyperparameters"], r["model_config"], r["distillation"]
    files = ", ".join(f"`{k}` {v / 1e6:.2f} MB" if v > 1e5 else f"`{k}` {v / 1e3:.1f} kB" for k, v in r["files"].items())
    rows = "\n".join(
        f"| {p['step']} | {p['train_time_s']:.0f} | {p['lr']:.2e} | "
        f"{'' if p['train_loss_ema'] is None else format(p['train_loss_ema'], '.3f')} | {p['heldout_loss']:.3f} | "
        f"{p.get('heldout_teacher_top1_agreement', float('nan')):.3f} |" for p in r["loss_curve"])
    return f"""{DRAFT_MARKER}

# {r['model']}: the embedded draft model

`speculative_config={{"method": "draft_model", "model": "{r['model']}", "num_speculative_tokens": k}}`
loads this checkpoint from `minivllm/assets/{r['model']}/` (no network). It is a smaller Qwen3 with the
embedded model's tokenizer (the same `tokenizer.json` bytes, vocab {m['vocab_size']}), trained by the same
script on the same corpus and held-out split, on the next-token distributions of `{d['teacher']}`
(knowledge distillation: {d['loss']}). Its `training_record.json` holds everything below.

- Model: hidden {m['hidden_size']}, {m['num_hidden_layers']} layer(s), {m['num_attention_heads']} query heads and
  {m['num_key_value_heads']} KV heads of dim {m['head_dim']}, SwiGLU MLP {m['intermediate_size']}, tied embeddings;
  {r['num_parameters']:,} parameters, stored in {r['stored_dtype']}.
  Files: {files}; total {sum(r['files'].values()) / 1e6:.2f} MB.
- Command: `{r['command']}` ({r['threads']} thread(s) on a shared machine), {r['steps']:,} steps of
  {h['batch_size']} x {h['seq_len']} tokens, training time {r['train_time_s']:.0f} s, wall time {r['wall_time_s']:.0f} s,
  corpus sha256 `{c['sha256'][:16]}...` (the main model's).
- Date (UTC): {r.get('date_utc', 'not recorded')}.
- Versions: Python {r['versions']['python']}, torch {r['versions']['torch']}, transformers {r['versions']['transformers']}.
- **Held-out loss: {r['heldout_loss']:.3f} nats/token** on the stored weights (the teacher's: {d['teacher_heldout_loss']:.3f}).
  **Top-1 agreement with the teacher on the held-out stream: {d['heldout_teacher_top1_agreement']:.1%}** of positions
  (what bounds greedy acceptance of a one-token draft; the engine's measured acceptance rate, from
  `bench --speculative ngram draft`, is in [benchmarks.md](benchmarks.md)).

| step | train time (s) | lr | train loss on the data (EMA) | held-out loss | held-out top-1 agreement |
|---:|---:|---:|---:|---:|---:|
{rows}

Reproduce: `python scripts/train_tiny_model.py {' '.join(r['command'].split()[1:])}`.{(chr(10) + 'Note: ' + r['notes']) if r.get('notes') else ''}
`tests/test_tiny_model_assets.py` checks the committed files.
"""


def splice(old: str, main: str | None, draft_record: dict | None) -> str:
    """``old`` with its main part replaced by ``main`` and/or its draft section by the rendering of
    ``draft_record`` (None: keep that part of ``old``)."""
    head, sep, tail = old.partition(DRAFT_MARKER)
    head = main if main is not None else head
    tail = render_section(draft_record) if draft_record is not None else (sep + tail if sep else "")
    return head.rstrip("\n") + "\n\n" + tail if tail else head
