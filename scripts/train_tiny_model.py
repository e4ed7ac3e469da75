#!/usr/bin/env python
"""Train the embedded default model ``minivllm-tiny`` on CPU, from text that ships with CPython.

What it does, top to bottom:

1. Corpus (about 2 MB): every topic of ``pydoc_data.topics`` plus the docstrings of a fixed list of
   standard-library modules, read with ``ast`` from the ``.py`` files under
   ``sysconfig.get_paths()["stdlib"]`` (nothing is imported, so no module side effects run). Modules
   and topics are visited in sorted order. Documents are rendered like ``help()`` output: a header,
   the module docstring, then ``class``/``def`` signature lines each followed by its indented docstring.
   About 5% of the bytes, as whole documents spread over that order, are held out for evaluation.
2. Tokenizer: byte-level BPE (``tokenizers``), vocab 4096, one special token ``<|endoftext|>`` (eos, bos
   and pad), trained on the training documents only. Byte-level, so any Unicode text round-trips.
3. Model: ``transformers.Qwen3ForCausalLM`` (hidden 256, 4 layers, 4 query heads / 2 kv heads of dim 64,
   MLP 768, tied embeddings, ~4.2M parameters), trained in fp32 with AdamW on random 256-token windows of
   the training token stream (documents joined by ``<|endoftext|>``), batch 4, linear warmup then cosine
   decay. Training is bounded by wall clock (``--minutes``); the cosine schedule runs over training time
   (evaluation time excluded), so a run on a faster machine takes more steps. ``--steps N`` instead runs
   exactly N steps with the schedule over steps, which replays a recorded run's step count
   deterministically (same versions and thread count).
4. Output in Hugging Face layout: config.json, model.safetensors, generation_config.json, tokenizer.json,
   tokenizer_config.json (with a ChatML-style chat template; the model never saw chat data) and
   training_record.json (hyperparameters, corpus hash, versions, loss curve, samples).
   With ``--doc`` it also renders the training record as Markdown (docs/tiny_model.md).
5. Storage dtype (``--store-dtype``, default float16): the trained fp32 weights are rounded to nearest
   fp16 before saving, which halves model.safetensors (16.8 -> 8.4 MB; the package budget is 15 MB).
   Loaders upcast fp16 to fp32 exactly, so every fp32 consumer (our engine on CPU, transformers with
   ``dtype=torch.float32``) computes with the same stored values. The reported held-out loss and the
   samples are measured on the stored (rounded) weights; the fp32 loss before rounding is kept too.
   ``--convert-existing DIR`` applies this rounding to an fp32 checkpoint already trained by this
   script, without retraining: it rebuilds the same held-out split, re-measures the loss, regenerates
   the samples and rewrites DIR/training_record.json (and ``--doc``).

Usage::

    python scripts/train_tiny_model.py --minutes 20 --threads 1          # the committed checkpoint
    python scripts/train_tiny_model.py --minutes 0.5 --out /tmp/tiny --doc ""   # smoke test
    python scripts/train_tiny_model.py --convert-existing minivllm/assets/minivllm-tiny   # fp32 -> fp16
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "minivllm" / "assets" / "minivllm-tiny"
DEFAULT_DOC = REPO_ROOT / "docs" / "tiny_model.md"

EOS = "<|endoftext|>"
HELDOUT_FRACTION = 0.05  # share of corpus bytes held out for evaluation (whole documents)

# Public top-level standard-library modules/packages whose source ships as .py files in every CPython
# 3.11 Linux build. Left out on purpose: GUI/terminal or optional-C-library ones (tkinter, turtle,
# turtledemo, idlelib, curses, ctypes, dbm, sqlite3, crypt), deprecated trees (distutils, lib2to3),
# bundles and generated tables (ensurepip, encodings, pydoc_data — whose topics we use directly),
# the test suite, and jokes (this, antigravity). Four private modules are in because they hold the
# pure-Python reference docs of decimal, io, collections.abc and threading.local. Packages contribute
# all their submodules (sorted), except test directories.
STDLIB_MODULES = (
    "_collections_abc _pydecimal _pyio _threading_local "
    "abc aifc argparse ast asynchat asyncio asyncore base64 bdb bisect bz2 cProfile calendar cgi cgitb "
    "chunk cmd code codecs codeop collections colorsys compileall concurrent configparser contextlib "
    "contextvars copy copyreg csv dataclasses datetime decimal difflib dis doctest email enum filecmp "
    "fileinput fnmatch fractions ftplib functools genericpath getopt getpass gettext glob graphlib gzip "
    "hashlib heapq hmac html http imaplib imghdr imp importlib inspect io ipaddress json keyword "
    "linecache locale logging lzma mailbox mailcap mimetypes modulefinder multiprocessing netrc nntplib "
    "ntpath nturl2path numbers opcode operator optparse os pathlib pdb pickle pickletools pipes pkgutil "
    "platform plistlib poplib posixpath pprint profile pstats pty py_compile pyclbr pydoc queue quopri "
    "random re reprlib rlcompleter runpy sched secrets selectors shelve shlex shutil signal site smtpd "
    "smtplib sndhdr socket socketserver sre_compile sre_constants sre_parse ssl stat statistics string "
    "stringprep struct subprocess sunau symtable sysconfig tabnanny tarfile telnetlib tempfile textwrap "
    "threading timeit token tokenize tomllib trace traceback tracemalloc tty types typing unittest "
    "urllib uu uuid venv warnings wave weakref webbrowser wsgiref xdrlib xml xmlrpc zipapp zipfile "
    "zipimport zoneinfo"
).split()

MODEL_CONFIG = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
)

SAMPLE_PROMPTS = ("The list type", "def ", "Return the")
SAMPLE_NEW_TOKENS = 48

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------------

def _module_files(stdlib: Path) -> list[tuple[str, Path]]:
    """(dotted module name, source path) for every module of STDLIB_MODULES, sorted by name."""
    out: list[tuple[str, Path]] = []
    for top in STDLIB_MODULES:
        single = stdlib / f"{top}.py"
        package = stdlib / top
        if single.is_file():
            out.append((top, single))
        elif (package / "__init__.py").is_file():
            for path in package.rglob("*.py"):
                rel = path.relative_to(stdlib).with_suffix("")
                parts = rel.parts
                if any(p in ("test", "tests", "__pycache__") for p in parts):
                    continue
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out.append((".".join(parts), path))
        else:
            raise FileNotFoundError(f"stdlib module {top!r} has no source under {stdlib}")
    return sorted(out)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line.strip() else "" for line in text.splitlines())


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    kw = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    sig = f"{kw} {node.name}({ast.unparse(node.args)})"
    if node.returns is not None:
        sig += f" -> {ast.unparse(node.returns)}"
    return sig


def _public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def render_module(name: str, source: str) -> str:
    """Render a module's docstrings the way ``help()`` lays them out (no import, ``ast`` only)."""
    tree = ast.parse(source)
    header = f"Module {name}"
    parts = [f"{header}\n{'=' * len(header)}"]
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(doc)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(node.name):
            d = ast.get_docstring(node)
            if d:
                parts.append(f"{_signature(node)}\n{_indent(d, '    ')}")
        elif isinstance(node, ast.ClassDef) and _public(node.name):
            bases = ", ".join(ast.unparse(b) for b in node.bases)
            block = [f"class {node.name}({bases})" if bases else f"class {node.name}"]
            d = ast.get_docstring(node)
            if d:
                block.append(_indent(d, "    "))
            methods = []
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(sub.name):
                    sd = ast.get_docstring(sub)
                    if sd:
                        methods.append(f"    {_signature(sub)}\n{_indent(sd, '        ')}")
            if d or methods:
                parts.append("\n\n".join(["\n".join(block)] + methods))
    return "\n\n".join(parts) + "\n"


def collect_corpus() -> list[tuple[str, str]]:
    """All documents as (name, text), in a fixed order: pydoc topics (sorted), then modules (sorted)."""
    from pydoc_data.topics import topics

    docs = [(f"topic:{key}", f"Topic {key}\n\n{topics[key].strip()}\n") for key in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name, path in _module_files(stdlib):
        text = render_module(name, path.read_text(encoding="utf-8"))
        if text.count("\n") > 3:  # skip modules with no docstrings at all
            docs.append((f"module:{name}", text))
    return docs


def split_corpus(docs):
    """Hold out whole documents, spread over the corpus: walking the fixed order, a document is held
    out when the held-out bytes so far are below HELDOUT_FRACTION of all bytes so far."""
    train, held = [], []
    seen = held_bytes = 0
    for doc in docs:
        size = len(doc[1].encode("utf-8"))
        if held_bytes < HELDOUT_FRACTION * seen:
            held.append(doc)
            held_bytes += size
        else:
            train.append(doc)
        seen += size
    return train, held


def corpus_sha256(docs) -> str:
    h = hashlib.sha256()
    for name, text in docs:
        h.update(name.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # No normalizer and byte-level pre-tokenization/decoding: decode(encode(s)) == s for any string.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer vocab is {tok.get_vocab_size()}, wanted {vocab_size}")
    return tok


def save_tokenizer(tok, out: Path, max_len: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    # Written by hand (not by transformers' save_pretrained) so the chat template sits inside
    # tokenizer_config.json and the class name loads in transformers 4.x and 5.x alike.
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def encode_docs(tok, docs, eos_id: int) -> list[int]:
    """Token stream: each document's ids followed by <|endoftext|>. Shape: flat list of ints."""
    ids: list[int] = []
    for enc in tok.encode_batch([text for _, text in docs]):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return ids


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------

def lr_at(step: int, progress: float, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from `peak` to `min_ratio * peak` over progress 0..1."""
    progress = min(max(progress, 0.0), 1.0)
    cos = min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return peak * cos * min(1.0, (step + 1) / warmup)


def evaluate(model, ids, seq_len: int, batch: int) -> float:
    """Mean next-token cross-entropy (nats/token) over non-overlapping windows of the held-out stream."""
    import torch
    import torch.nn.functional as F

    data = torch.tensor(ids, dtype=torch.long)
    n_full = (len(data) - 1) // seq_len
    windows = [data[i * seq_len : i * seq_len + seq_len + 1] for i in range(n_full)]
    tail = data[n_full * seq_len :]
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        groups = [torch.stack(windows[i : i + batch]) for i in range(0, len(windows), batch)]
        if len(tail) >= 2:
            groups.append(tail[None])
        for x in groups:
            logits = model(input_ids=x[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
    model.train()
    return total / count


def generate_samples(model_dir: Path) -> list[dict]:
    """Greedy (and greedy with repetition_penalty 1.3) continuations with transformers' generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        for penalty in (1.0, 1.3):
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=SAMPLE_NEW_TOKENS,
                    repetition_penalty=penalty,
                    pad_token_id=tok.pad_token_id,
                )
            new = out[0, ids.shape[1] :].tolist()
            samples.append(
                {
                    "prompt": prompt,
                    "prompt_token_ids": ids[0].tolist(),
                    "repetition_penalty": penalty,
                    "max_new_tokens": SAMPLE_NEW_TOKENS,
                    "token_ids": new,
                    "text": tok.decode(new, skip_special_tokens=False),
                }
            )
    return samples


STORE_DTYPES = ("float32", "float16")


def round_to_store_dtype(model, store_dtype: str) -> dict:
    """Round every parameter of ``model`` in place to the nearest ``store_dtype`` value, kept in fp32.

    After this the fp32 model holds exactly the values the checkpoint will store (fp16 -> fp32 is an
    exact upcast), so evaluating it measures the stored weights. fp16 rounding is IEEE
    round-to-nearest-even (torch ``.to(torch.float16)``); a value beyond the fp16 range (|w| > 65504)
    would become inf, which is refused.

    Returns: stats over all parameters (tied weights once): ``max_abs_weight``, ``max_abs_error``,
    ``max_rel_error_normal`` (|w16 - w32| / |w32| over weights in fp16's normal range, |w| >= 2**-14
    = 6.1e-5; at most 2**-11 = 4.9e-4 by IEEE 754), ``max_rel_error`` (the same over all nonzero
    weights, where tiny subnormal ones keep fewer bits and one flushed to zero counts 1.0),
    ``num_subnormal`` (nonzero weights stored as fp16 subnormals) and ``num_flushed_to_zero``.
    """
    import torch

    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store dtype {store_dtype!r}: choose one of {STORE_DTYPES}")
    stats = {"store_dtype": store_dtype, "max_abs_weight": 0.0, "max_abs_error": 0.0,
             "max_rel_error_normal": 0.0, "max_rel_error": 0.0, "num_subnormal": 0, "num_flushed_to_zero": 0}
    tiny = torch.finfo(torch.float16).tiny  # 2**-14, the smallest normal fp16
    with torch.no_grad():
        for p in model.parameters():  # parameters() yields each tied tensor once
            w = p.detach().float()
            stats["max_abs_weight"] = max(stats["max_abs_weight"], w.abs().max().item())
            if store_dtype == "float32":
                continue
            r = w.to(torch.float16)
            if not torch.isfinite(r).all():
                raise ValueError(f"a weight of magnitude {w.abs().max().item():.4g} overflows float16")
            r = r.float()
            err = (r - w).abs()
            nz = w != 0
            normal = w.abs() >= tiny
            stats["max_abs_error"] = max(stats["max_abs_error"], err.max().item())
            if nz.any():
                stats["max_rel_error"] = max(stats["max_rel_error"], (err[nz] / w[nz].abs()).max().item())
            if normal.any():
                stats["max_rel_error_normal"] = max(stats["max_rel_error_normal"],
                                                    (err[normal] / w[normal].abs()).max().item())
            stats["num_subnormal"] += int((nz & (r.abs() < tiny) & (r != 0)).sum())
            stats["num_flushed_to_zero"] += int((nz & (r == 0)).sum())
            p.copy_(r)
    return stats


def save_checkpoint(model, out: Path, store_dtype: str) -> None:
    """save_pretrained in ``store_dtype`` (model.safetensors + config.json), leaving ``model`` in fp32.

    Call round_to_store_dtype first: the cast here is then exact. config.json gets both dtype
    spellings ("dtype", transformers 5; "torch_dtype", transformers 4.x and real Qwen3 checkpoints)
    set to the stored dtype, and a top-level rope_theta next to rope_parameters.
    """
    import torch

    dtype = getattr(torch, store_dtype)
    model.to(dtype)
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        model.float()
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = store_dtype
    cfg["torch_dtype"] = store_dtype
    cfg["rope_theta"] = MODEL_CONFIG["rope_theta"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def heldout_metrics(loss: float, heldout_tokens: int, heldout_bytes: int) -> dict:
    """heldout_loss (nats/token), perplexity and bits per byte of the held-out stream."""
    return {
        "heldout_loss": round(loss, 4),
        "heldout_perplexity": round(math.exp(loss), 2),
        "heldout_bits_per_byte": round(loss * (heldout_tokens - 1) / math.log(2) / heldout_bytes, 4),
    }


def write_record(record: dict, out: Path) -> dict:
    """Write training_record.json, then again with the final file sizes in ``files``."""
    (out / "training_record.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    record["files"] = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    (out / "training_record.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return record


def train(args) -> dict:
    import torch
    import torch.nn.functional as F
    import tokenizers
    import transformers
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from minivllm.utils.env_report import cpu_name  # for the record

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(args.threads)
    except RuntimeError:  # already set once in this process
        pass
    torch.manual_seed(args.seed)
    wall0 = time.perf_counter()

    docs = collect_corpus()
    train_docs, held_docs = split_corpus(docs)
    sha = corpus_sha256(docs)
    chars = sum(len(t) for _, t in docs)
    nbytes = sum(len(t.encode("utf-8")) for _, t in docs)
    held_bytes = sum(len(t.encode("utf-8")) for _, t in held_docs)
    print(f"corpus: {len(docs)} docs, {nbytes / 1e6:.2f} MB, sha256 {sha[:16]}..; "
          f"held out {len(held_docs)} docs ({held_bytes / nbytes:.1%} of bytes)", flush=True)

    if args.tokenizer:  # a draft model shares its target's tokenizer, byte for byte
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
        if tok.get_vocab_size() != MODEL_CONFIG["vocab_size"]:
            raise ValueError(f"--tokenizer {args.tokenizer}: vocab {tok.get_vocab_size()}, "
                             f"wanted {MODEL_CONFIG['vocab_size']}")
    else:
        tok = train_tokenizer([t for _, t in train_docs], MODEL_CONFIG["vocab_size"])
    eos_id = tok.token_to_id(EOS)
    train_ids = encode_docs(tok, train_docs, eos_id)
    held_ids = encode_docs(tok, held_docs, eos_id)
    print(f"tokens: train {len(train_ids)}, held-out {len(held_ids)}; "
          f"{nbytes / (len(train_ids) + len(held_ids)):.2f} bytes/token", flush=True)

    model_config = dict(MODEL_CONFIG, num_hidden_layers=args.layers, intermediate_size=args.intermediate_size)
    config = Qwen3Config(**model_config, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model = Qwen3ForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    print(f"model: {n_params / 1e6:.3f}M parameters", flush=True)
    distill = None
    if args.distill_from:  # see scripts/tiny_draft.py
        from tiny_draft import Distiller

        distill = Distiller(args.distill_from, held_ids, T=args.seq_len, vocab_size=MODEL_CONFIG["vocab_size"])
        print(f"distilling from {args.distill_from}: teacher held-out loss {distill.teacher_heldout_loss:.4f}",
              flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    data = torch.tensor(train_ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(args.seed)
    B, T = args.batch_size, args.seq_len
    budget_s = args.minutes * 60.0

    curve = []
    next_eval = 0  # evaluate when progress crosses next_eval / args.evals
    train_time = 0.0
    step = 0
    ema = None
    last_print = time.perf_counter()
    model.train()
    while True:
        progress = step / args.steps if args.steps else train_time / budget_s
        if progress >= next_eval / args.evals or progress >= 1.0:
            t_eval = time.perf_counter()
            held = evaluate(model, held_ids, T, batch=8)
            extra = {} if distill is None else {"heldout_teacher_top1_agreement": distill.agreement(model)}
            curve.append({
                "step": step,
                "tokens_seen": step * B * T,
                "train_time_s": round(train_time, 1),
                "wall_s": round(time.perf_counter() - wall0, 1),
                "lr": lr_at(step, progress, args.lr, args.warmup_steps, args.min_lr_ratio),
                "train_loss_ema": None if ema is None else round(ema, 4),
                "heldout_loss": round(held, 4),
                **extra,
            })
            print(f"[eval] step {step} train_time {train_time:.0f}s held-out {held:.4f} {extra} "
                  f"(eval took {time.perf_counter() - t_eval:.1f}s)", flush=True)
            next_eval = math.floor(progress * args.evals) + 1
        if progress >= 1.0:
            break

        t0 = time.perf_counter()
        lr = lr_at(step, progress, args.lr, args.warmup_steps, args.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - T - 1, (B,), generator=gen)
        x = torch.stack([data[s : s + T + 1] for s in starts.tolist()])
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        data_loss = loss.item()
        if distill is not None:  # trained on the teacher's distributions; the data loss is still logged
            loss = distill.loss(logits, x[:, :-1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        ema = data_loss if ema is None else 0.98 * ema + 0.02 * data_loss
        train_time += time.perf_counter() - t0
        if time.perf_counter() - last_print > 30:
            last_print = time.perf_counter()
            print(f"step {step} loss(ema) {ema:.4f} lr {lr:.2e} "
                  f"{step * B * T / train_time:.0f} tok/s", flush=True)

    loss_fp32 = curve[-1]["heldout_loss"]
    rounding = round_to_store_dtype(model, args.store_dtype)
    loss_stored = loss_fp32
    if args.store_dtype != "float32":
        loss_stored = evaluate(model, held_ids, T, batch=8)
        rounding["heldout_loss_change"] = round(loss_stored - held, 6)  # `held`: the last fp32 eval, unrounded
    print(f"stored as {args.store_dtype}: held-out {loss_stored:.4f} (fp32 {loss_fp32:.4f}); {rounding}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, out, args.store_dtype)
    GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    ).save_pretrained(out)
    save_tokenizer(tok, out, MODEL_CONFIG["max_position_embeddings"])
    if distill is not None:
        from tiny_draft import mark_draft_config

        mark_draft_config(out, args.num_speculative_tokens)
    if args.tokenizer:  # the same bytes as the target's file, not a re-serialisation
        import shutil

        shutil.copyfile(Path(args.tokenizer) / "tokenizer.json", out / "tokenizer.json")

    samples = generate_samples(out)
    for s in samples:
        print(f"[sample] {s['prompt']!r} rp={s['repetition_penalty']}: {s['text']!r}", flush=True)

    record = {
        "model": args.name,
        "script": "scripts/train_tiny_model.py",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(time.time() - (time.perf_counter() - wall0)))
                    + time.strftime("-%H:%M", time.gmtime()),
        "seed": args.seed,
        "threads": args.threads,
        "note_threads": "trained with torch.set_num_threads(threads) on a CPU machine shared with other work",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "platform": platform.platform(),
            "cpu": cpu_name(),
        },
        "corpus": {
            "sources": "pydoc_data.topics + docstrings (via ast) of the stdlib modules listed in the script",
            "sha256": sha,
            "num_docs": len(docs),
            "num_topic_docs": sum(name.startswith("topic:") for name, _ in docs),
            "num_module_docs": sum(name.startswith("module:") for name, _ in docs),
            "num_train_docs": len(train_docs),
            "num_heldout_docs": len(held_docs),
            "heldout_rule": (f"whole documents, in order (topics sorted, then modules sorted); a document is held out "
                             f"when held-out bytes so far < {HELDOUT_FRACTION} x all bytes so far"),
            "chars": chars,
            "bytes": nbytes,
            "heldout_bytes": held_bytes,
            "train_tokens": len(train_ids),
            "heldout_tokens": len(held_ids),
            "heldout_docs": [name for name, _ in held_docs],
        },
        "tokenizer": {
            "type": "byte-level BPE (tokenizers)",
            "vocab_size": tok.get_vocab_size(),
            "special_tokens": {EOS: eos_id},
            "trained_on": (f"copied from {Path(args.tokenizer).name} (--tokenizer)" if args.tokenizer
                           else "training documents only"),
            "sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        },
        "model_config": model_config,
        "num_parameters": n_params,
        "hyperparameters": {
            "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8)",
            "peak_lr": args.lr,
            "warmup_steps": args.warmup_steps,
            "min_lr_ratio": args.min_lr_ratio,
            "schedule": ("linear warmup, cosine over training time (--minutes)" if not args.steps
                         else "linear warmup, cosine over steps (--steps)"),
            "weight_decay": args.weight_decay,
            "grad_clip": args.grad_clip,
            "batch_size": B,
            "seq_len": T,
            "minutes": None if args.steps else args.minutes,
            "steps": args.steps,
        },
        "steps": step,
        "tokens_seen": step * B * T,
        "train_time_s": round(train_time, 1),
        "wall_time_s": round(time.perf_counter() - wall0, 1),
        "stored_dtype": args.store_dtype,
        "rounding": rounding,
        "heldout_loss_fp32_before_rounding": loss_fp32,
        **heldout_metrics(loss_stored, len(held_ids), held_bytes),
        "loss_curve": curve,
        "samples": samples,
    }
    if distill is not None:
        record["distillation"] = distill.record(model, args.distill_from)
    return write_record(record, out)


def convert_existing(directory: Path, store_dtype: str, command: str) -> dict:
    """Round an fp32 checkpoint trained by this script to ``store_dtype`` in place, without retraining.

    Rebuilds the corpus and the held-out split with this script's own code, encodes it with the
    checkpoint's tokenizer, and refuses to go on unless the corpus hash and held-out token count
    equal the record's (so the loss is measured on the same held-out stream). Then: held-out loss of
    the fp32 weights as loaded (a check against the record), rounding, held-out loss of the stored
    weights, save, samples regenerated from the saved files (loaded back in fp32), and the record
    rewritten with ``stored_dtype``, ``rounding``, ``heldout_loss_fp32_before_rounding`` and
    ``heldout_loss`` (of the stored weights). The loss curve is left as trained (fp32).
    """
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM

    record_path = directory / "training_record.json"
    if not record_path.is_file():
        raise ValueError(f"--convert-existing {directory}: no training_record.json there")
    record = json.loads(record_path.read_text())
    if record.get("stored_dtype", "float32") != "float32":
        raise ValueError(f"--convert-existing {directory}: already stored as {record['stored_dtype']}; "
                         "conversion starts from the fp32 checkpoint")
    torch.set_num_threads(record.get("threads", 1))

    docs = collect_corpus()
    _, held_docs = split_corpus(docs)
    sha = corpus_sha256(docs)
    if sha != record["corpus"]["sha256"]:
        raise ValueError(f"corpus sha256 {sha} differs from the record's {record['corpus']['sha256']} "
                         f"(different CPython?); cannot rebuild the same held-out split")
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    held_ids = encode_docs(tok, held_docs, tok.token_to_id(EOS))
    if len(held_ids) != record["corpus"]["heldout_tokens"]:
        raise ValueError(f"held-out stream has {len(held_ids)} tokens, record says "
                         f"{record['corpus']['heldout_tokens']}")
    held_bytes = record["corpus"]["heldout_bytes"]
    T = record["hyperparameters"]["seq_len"]

    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32)
    loss_fp32_exact = evaluate(model, held_ids, T, batch=8)
    loss_fp32 = round(loss_fp32_exact, 4)
    print(f"fp32 as loaded: held-out {loss_fp32:.4f} (record: {record['heldout_loss']:.4f})", flush=True)
    if abs(loss_fp32 - record["heldout_loss"]) > 1e-3:
        raise ValueError(f"fp32 held-out loss {loss_fp32} does not reproduce the record's {record['heldout_loss']}")
    rounding = round_to_store_dtype(model, store_dtype)
    loss_stored = evaluate(model, held_ids, T, batch=8)
    rounding["heldout_loss_change"] = round(loss_stored - loss_fp32_exact, 6)
    print(f"stored as {store_dtype}: held-out {loss_stored:.6f} (fp32 {loss_fp32_exact:.6f}); {rounding}", flush=True)
    save_checkpoint(model, directory, store_dtype)

    samples = generate_samples(directory)
    for s in samples:
        print(f"[sample] {s['prompt']!r} rp={s['repetition_penalty']}: {s['text']!r}", flush=True)

    rebuilt = {}
    for key, value in record.items():  # keep the record's key order, new keys before the loss
        if key in ("heldout_loss", "heldout_perplexity", "heldout_bits_per_byte", "files"):
            continue
        if key == "loss_curve":
            rebuilt["stored_dtype"] = store_dtype
            rebuilt["rounding"] = rounding
            rebuilt["conversion_command"] = command
            rebuilt["heldout_loss_fp32_before_rounding"] = loss_fp32
            rebuilt.update(heldout_metrics(loss_stored, len(held_ids), held_bytes))
        rebuilt[key] = samples if key == "samples" else value
    return write_record(rebuilt, directory)


# ----------------------------------------------------------------------------------------------------
# Markdown training record
# ----------------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def run_line(r: dict) -> str:
    """When and on which CPU the run was made, as far as its record says."""
    when = f"{r['date_utc']} UTC" if r.get("date_utc") else r.get("date_note", "not recorded")
    cpu = r.get("versions", {}).get("cpu") or r.get("cpu_note") or "not recorded"
    return f"Date: {when}. CPU: {cpu}."


def render_doc(r: dict) -> str:
    v, c, h = r["versions"], r["corpus"], r["hyperparameters"]
    rows = "\n".join(
        f"| {p['step']} | {p['tokens_seen']:,} | {p['train_time_s']:.0f} | {p['lr']:.2e} | "
        f"{'' if p['train_loss_ema'] is None else format(p['train_loss_ema'], '.3f')} | {p['heldout_loss']:.3f} |"
        for p in r["loss_curve"]
    )
    samples = "\n".join(
        f"| `` {s['prompt']!r} `` | {s['repetition_penalty']} | `` {_cell(json.dumps(s['text'], ensure_ascii=False))} `` |"
        for s in r["samples"]
    )
    total = sum(r["files"].values())
    files = ", ".join(f"`{k}` {v / 1e6:.2f} MB" if v > 1e5 else f"`{k}` {v / 1e3:.1f} kB" for k, v in r["files"].items())
    minutes = r["train_time_s"] / 60
    curve = r["loss_curve"]
    still_falling = len(curve) >= 2 and curve[-1]["heldout_loss"] < curve[-2]["heldout_loss"]
    stored = r.get("stored_dtype", "float32")  # records written before --store-dtype existed: fp32
    bytes_per_param = {"float32": 4, "float16": 2}[stored]
    if stored == "float32":
        weights_note = "fp32 weights."
        loss_note = ""
    else:
        rd = r["rounding"]
        weights_note = (
            f"Trained in fp32, stored in {stored}: each weight rounded to the nearest {stored} value (largest\n"
            f"absolute weight {rd['max_abs_weight']:.3g}, far inside fp16's range of 65504; largest relative rounding\n"
            f"error {rd['max_rel_error_normal']:.2e} for weights in fp16's normal range, |w| >= 6.1e-5; "
            f"{rd['num_subnormal']:,} tiny weights stored\nas subnormals and {rd['num_flushed_to_zero']:,} "
            f"flushed to zero, largest absolute error {rd['max_abs_error']:.1e}).\nLoaders upcast to fp32 exactly: our engine on CPU (dtype \"auto\" is fp32 there; it ignores the config's\n"
            f"dtype) and transformers with `dtype=torch.float32` compute with the\n"
            f"same stored values, so their outputs can be compared exactly.")
        loss_note = (
            f"This is the loss of the stored {stored} weights (run in fp32); the fp32 weights before\n"
            f"rounding scored {r['heldout_loss_fp32_before_rounding']:.4f} (the last row of the table below), a "
            f"difference of {r['rounding']['heldout_loss_change']:+.6f} nats.\n")
    trend = ("The held-out loss was still falling when the time budget ran out" if still_falling
             else "The held-out loss had stopped falling by the end")
    conversion = "" if "conversion_command" not in r else (
        f"\nThe committed checkpoint was trained with the command above in fp32 (`--store-dtype` did not exist\n"
        f"yet) and then rounded, without retraining, by `{r['conversion_command']}`, which\n"
        f"re-measured the held-out loss on the same split and regenerated the samples.")
    return f"""# minivllm-tiny: the embedded default model

`LLM()` with no model loads this checkpoint from `minivllm/assets/minivllm-tiny/` (no network needed).
It is a real Qwen3-architecture model trained by `scripts/train_tiny_model.py`; the file
`training_record.json` next to the weights holds everything below in machine-readable form.

## What it is, honestly

A {r['num_parameters'] / 1e6:.1f}M-parameter model trained for {minutes:.{0 if minutes >= 10 else 1}f} minutes on
{r['threads']} CPU thread(s), on {c['bytes'] / 1e6:.1f} MB of Python's own documentation. It has learned the *shape* of Python's
docs (English words, `def` lines, indentation, reStructuredText markup, which words follow which), not
their meaning: its continuations are fluent-looking, often repetitive, and usually wrong. Greedy decoding
falls into loops quickly; a repetition penalty helps a little. It is a stand-in with real weights, a real
tokenizer and real shapes so that the engine, the tests and the course have something to run anywhere,
and so that outputs can be compared token for token against Hugging Face `generate`. Use a real
checkpoint (Qwen3-0.6B and up) for anything where the text matters.

The tokenizer carries a ChatML-style `chat_template` (`<|im_start|>role\\n...<|im_end|>`) so that
`LLM.chat` can be demonstrated, but **the model was never trained on chat data**, and `<|im_start|>` /
`<|im_end|>` are not special tokens here (they are spelled out in bytes); expect a docs-like continuation,
not an answer.

## Model

Qwen3 (`Qwen3ForCausalLM`): hidden 256, 4 layers, 4 query heads and 2 KV heads of dim 64 (GQA),
SwiGLU MLP 768, RMSNorm eps 1e-6 (also on q and k per head, as Qwen3 does), RoPE theta 10000,
max positions 2048, vocab 4096, tied input/output embeddings (so `model.safetensors` holds
`model.embed_tokens.weight` and no `lm_head.weight`; loaders must tie them).
{weights_note}
Files: {files}; total {total / 1e6:.1f} MB
(the {stored} weights alone are {r['num_parameters'] * bytes_per_param / 1e6:.1f} MB).

## Data

- Sources: all {c['num_topic_docs']} topics of `pydoc_data.topics` and the docstrings of
  {c['num_module_docs']} standard-library modules (a fixed list in the script, submodules of packages
  included), read with `ast` from the source files (no imports) and rendered like `help()` output
  (module docstring, then `class`/`def` signature lines with indented docstrings).
- {c['num_docs']} documents, {c['bytes']:,} bytes, corpus sha256
  `{c['sha256']}`
  (Python {v['python']}; another CPython patch release gives a slightly different corpus and hash).
- Held out for evaluation: {c['num_heldout_docs']} whole documents, {c['heldout_bytes']:,} bytes
  ({c['heldout_bytes'] / c['bytes']:.1%}), {c['heldout_tokens']:,} tokens: {', '.join(f'`{n}`' for n in c['heldout_docs'])}.
  Rule: {c['heldout_rule']}. Training: {c['train_tokens']:,} tokens.
- Tokenizer: byte-level BPE trained with `tokenizers` on the training documents, vocab {r['tokenizer']['vocab_size']},
  one special token `<|endoftext|>` (id {r['tokenizer']['special_tokens']['<|endoftext|>']}) used as eos, bos and pad.
  No BOS is prepended when encoding. Documents are joined with `<|endoftext|>` for training. Any Unicode
  text round-trips (`decode(encode(s)) == s`).

## Training

AdamW (betas 0.9/0.95, weight decay {h['weight_decay']} on matrices), peak lr {h['peak_lr']}, {h['warmup_steps']} warmup
steps, cosine decay to {h['min_lr_ratio']}x peak over the {'training time' if h['minutes'] else 'steps'}, grad clip {h['grad_clip']},
batch {h['batch_size']} x {h['seq_len']} tokens drawn uniformly at random from the training stream, seed {r['seed']}.
Command: `{r['command']}`.
`torch.set_num_threads({r['threads']})`: the machine was shared with other developers' work, so
throughput (and hence the number of steps reached in the time budget) depends on the load at the time.
{r['steps']:,} steps, {r['tokens_seen']:,} tokens seen ({r['tokens_seen'] / c['train_tokens']:.1f} passes over the training
tokens), training time {r['train_time_s']:.0f} s, wall time {r['wall_time_s']:.0f} s including corpus, tokenizer,
evaluations and saving. To replay this run's step count exactly (same versions and thread count), pass
`--steps {r['steps']}` (the schedule then runs over steps rather than time, so the learning rate at each
step differs slightly from this time-scheduled run).

Versions: Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, tokenizers {v['tokenizers']}
({v['platform']}). {run_line(r)}

**Held-out loss: {r['heldout_loss']:.3f} nats/token** (perplexity {r['heldout_perplexity']},
about {r['heldout_bits_per_byte']:.2f} bits per byte). For scale: a uniform guess over 4096 tokens is 8.32 nats.
{loss_note}Train loss is an exponential moving average (factor 0.98) of the per-batch loss; it ends
{curve[-1]['heldout_loss'] - (curve[-1]['train_loss_ema'] or 0):.2f} nats below the held-out loss, because after
{r['tokens_seen'] / c['train_tokens']:.1f} passes the model has partly memorised its training documents and the
held-out documents are different modules and topics. {trend}.

| step | tokens seen | train time (s) | lr | train loss (EMA) | held-out loss |
|---:|---:|---:|---:|---:|---:|
{rows}

## Samples

Produced with transformers `generate` from the saved checkpoint (loaded in fp32), greedy (`do_sample=False`),
{SAMPLE_NEW_TOKENS} new tokens, with and without `repetition_penalty=1.3`. The token ids are in
`training_record.json` (`samples`), so the engine's greedy output can be compared with them exactly.
The prompt `'def '` ends in a lone space token (`Ġ`); in training text the space is almost always merged
into the next word's token (`Ġget`), so that prompt is out of distribution and the greedy continuation
degenerates: a small, real example of why prompts should not end in a space with BPE tokenizers.

| prompt | repetition penalty | continuation |
|---|---:|---|
{samples}

## Reproduce

```
python scripts/train_tiny_model.py --minutes 20 --threads 1
```
writes the checkpoint into `minivllm/assets/minivllm-tiny/` (weights in `--store-dtype`, default float16)
and re-renders this file.{conversion}
`tests/test_tiny_model_assets.py` checks the committed files.
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python scripts/train_tiny_model.py",
                                description="Train a tiny Qwen3 on CPU from text that ships with CPython: the "
                                            "embedded default model minivllm-tiny, or (--distill-from) a draft "
                                            "model for it.")
    p.add_argument("--name", default="minivllm-tiny",
                   help="model name (record and default output directory minivllm/assets/NAME)")
    p.add_argument("--out", default=None, help="output directory (Hugging Face layout); default: the name's")
    p.add_argument("--doc", default=str(DEFAULT_DOC), help="Markdown training record to write ('' to skip)")
    p.add_argument("--minutes", type=float, default=20.0, help="training-time budget in minutes")
    p.add_argument("--steps", type=int, default=None, help="run exactly this many steps instead of --minutes")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: shared machine)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and batch order (default 0)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of AdamW (default 2e-3)")
    p.add_argument("--warmup-steps", type=int, default=100, help="linear warm-up steps (default 100)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="the cosine schedule ends at this fraction of --lr (default 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip (default 1.0)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence (default 256)")
    p.add_argument("--evals", type=int, default=20, help="number of held-out evaluations over the run")
    p.add_argument("--layers", type=int, default=MODEL_CONFIG["num_hidden_layers"], help="decoder layers")
    p.add_argument("--intermediate-size", type=int, default=MODEL_CONFIG["intermediate_size"], help="MLP width")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="reuse DIR/tokenizer.json (e.g. a draft model sharing its target's) instead of training one")
    p.add_argument("--distill-from", metavar="DIR", default=None,
                   help="train on the next-token distributions of the checkpoint in DIR (a draft model for it)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="with --distill-from: the draft's default k, written into its config.json")
    p.add_argument("--render-doc", metavar="RECORD", default=None,
                   help="only re-render --doc from an existing training_record.json, no training")
    p.add_argument("--store-dtype", choices=STORE_DTYPES, default="float16",
                   help="dtype of the saved weights (trained in fp32, rounded to nearest)")
    p.add_argument("--convert-existing", metavar="DIR", default=None,
                   help="no training: round the fp32 checkpoint in DIR to --store-dtype, re-measure, "
                        "rewrite DIR/training_record.json and --doc")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(DEFAULT_OUT.parent / args.name)
    if args.convert_existing:
        command = " ".join([Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv)))
        record = convert_existing(Path(args.convert_existing), args.store_dtype, command)
        print(f"held-out loss {record['heldout_loss']:.4f} nats/token as {record['stored_dtype']} "
              f"({record['heldout_loss_fp32_before_rounding']:.4f} in fp32); files: {record['files']}", flush=True)
        if args.doc:
            write_doc(Path(args.doc), record)
            print(f"wrote {args.doc}", flush=True)
        return
    if args.render_doc:
        if not args.doc:
            raise ValueError("--render-doc needs --doc to name the Markdown file to write")
        record = json.loads(Path(args.render_doc).read_text())
        write_doc(Path(args.doc), record)
        print(f"wrote {args.doc}", flush=True)
        return
    if not args.minutes > 0:
        raise ValueError(f"--minutes must be > 0, got {args.minutes}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    for name in ("threads", "batch_size", "seq_len", "evals", "warmup_steps", "layers", "intermediate_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len > MODEL_CONFIG["max_position_embeddings"]:
        raise ValueError(f"--seq-len {args.seq_len} exceeds max_position_embeddings")

    record = train(args)
    print(f"held-out loss {record['heldout_loss']:.4f} nats/token after {record['steps']} steps; "
          f"files: {record['files']}", flush=True)
    if args.doc:
        Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
        write_doc(Path(args.doc), record)
        print(f"wrote {args.doc}", flush=True)


def write_doc(path: Path, record: dict) -> None:
    """Render ``record`` into ``path``: the main model's record is the file, a draft model's
    (``distillation`` in the record) its own section at the end (see ``tiny_draft.splice``);
    each keeps the other's part."""
    from tiny_draft import splice

    old = path.read_text() if path.is_file() else ""
    path.write_text(splice(old, render_doc(record) if "distillation" not in record else None,
                           None if "distillation" not in record else record))


if __name__ == "__main__":
    main()
