"""Where a model comes from: the embedded checkpoint, a local directory (or a Hub id's snapshot in the
Hugging Face cache), or a random preset."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_MODEL_NAME = "minivllm-tiny"
EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / EMBEDDED_MODEL_NAME
#: The embedded draft model for speculative decoding (same tokenizer; docs/tiny_model.md).
EMBEDDED_DRAFT_NAME = "minivllm-tiny-draft"
EMBEDDED_CHECKPOINTS = {name: EMBEDDED_MODEL_DIR.parent / name for name in (EMBEDDED_MODEL_NAME, EMBEDDED_DRAFT_NAME)}
RANDOM_PREFIX = "random:"


@dataclass
class ModelSource:
    """A resolved model.

    Attributes:
        name: what the user asked for (display name).
        hf_config: the transformers config.
        checkpoint_dir: directory holding safetensors, or None for random weights.
        tokenizer_dir: directory holding the tokenizer files; None for a checkpoint directory that
            has none (``with_tokenizer`` then needs ``LLM(tokenizer=...)``).
        eos_token_ids: end-of-sequence ids from generation_config.json, else the tokenizer's.
    """

    name: str
    hf_config: object
    checkpoint_dir: Path | None
    tokenizer_dir: Path | None
    eos_token_ids: list[int]

    @property
    def is_random(self) -> bool:
        return self.checkpoint_dir is None


def read_json_file(path: Path) -> dict:
    """A checkpoint's JSON file, an object. Raises ``ValueError`` naming the file when it is not
    valid JSON or holds something else than an object."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not a valid JSON file ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} holds a JSON {type(value).__name__}, not an object")
    return value


def load_tokenizer(directory: Path):
    """``AutoTokenizer.from_pretrained(directory)`` (local files only).

    Raises:
        ValueError: the tokenizer could not be loaded, naming the JSON file that does not parse
            where one does not (transformers' own message names none), else the directory."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # a file that does not parse, or of the wrong shape (KeyError, TypeError, ...)
        for path in sorted(Path(directory).glob("*.json")):
            read_json_file(path)
        raise ValueError(f"the tokenizer in {str(directory)!r} could not be loaded: {e!r}") from None


def _eos_ids(directory: Path, tokenizer_dir: Path | None) -> list[int]:
    gen = directory / "generation_config.json"
    if gen.is_file():
        eos = read_json_file(gen).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    if tokenizer_dir is None:
        return []
    tok_cfg = tokenizer_dir / "tokenizer_config.json"
    tok_json = tokenizer_dir / "tokenizer.json"
    if tok_cfg.is_file() and tok_json.is_file():
        eos_tok = read_json_file(tok_cfg).get("eos_token")
        if isinstance(eos_tok, dict):
            eos_tok = eos_tok.get("content")
        for added in read_json_file(tok_json).get("added_tokens", []):
            if added.get("content") == eos_tok:
                return [added["id"]]
    return []


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    """Resolve ``LLM(model=...)``.

    ``None`` -> ``$MINIVLLM_MODEL`` if set, else the embedded model; ``"minivllm-tiny"``
    -> the embedded model (``"minivllm-tiny-draft"``: its embedded draft model); ``"random:<preset>"`` -> a packaged config with random weights
    and the embedded tokenizer; anything else must be a local Hugging Face checkpoint
    directory, or a Hub id (``org/name``, not an existing path) whose snapshot is in the Hugging
    Face Hub cache, as vLLM finds it there offline (nothing is downloaded at run time).

    Raises:
        FileNotFoundError: the path does not exist or has no config.json (naming the Hub download
            command where the name is a Hub id), or a Hub id's cached snapshot has no weights.
        ValueError: an empty name, an unknown random preset, or a config, generation config or tokenizer file that
            does not parse (naming the file); a pre-quantized checkpoint (its config has a
            ``quantization_config``: its weights are not floats; naming the method).
        Either error names ``$MINIVLLM_MODEL`` when the model came from it.
    """
    if model is None:
        from_env = os.environ.get("MINIVLLM_MODEL")
        if not from_env:
            return _resolve_named(EMBEDDED_MODEL_NAME)
        try:
            return _resolve_named(from_env)
        except (FileNotFoundError, ValueError) as e:  # a script that names no model would not say where it came from
            kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError
            raise kind(f"$MINIVLLM_MODEL (no model was given, so the environment's was used): {e}") from None
    if not str(model).strip():  # Path("") is the working directory: "no config.json in '.'" named no mistake
        raise ValueError(f"model={model!r}: empty; give a checkpoint directory, {EMBEDDED_MODEL_NAME!r}, "
                         "'random:<preset>', or None for the default")
    return _resolve_named(str(model))


def _resolve_named(name: str) -> ModelSource:
    from transformers import AutoConfig

    if name.startswith(RANDOM_PREFIX):
        from minivllm.models.presets import load_preset_config

        cfg = load_preset_config(name[len(RANDOM_PREFIX):])
        return ModelSource(name, cfg, None, EMBEDDED_MODEL_DIR, _eos_ids(EMBEDDED_MODEL_DIR, EMBEDDED_MODEL_DIR))
    directory = EMBEDDED_CHECKPOINTS.get(name) or Path(name).expanduser()
    cached = _hub_cache_snapshot(name) if not directory.exists() and _HUB_ID.fullmatch(name) else None
    if cached is not None:
        if not any(cached.glob("*.safetensors")):  # a snapshot with the config and tokenizer only
            raise FileNotFoundError(
                f"model {name!r}: the Hugging Face Hub cache's snapshot {str(cached)!r} has no *.safetensors "
                f"weights (an earlier run fetched only its config or tokenizer): `hf download {name}`, where there "
                "is internet, completes it (nothing is downloaded at run time)")
        directory = cached
    if not (directory / "config.json").is_file():
        # a missing directory is named as such: "no config.json in it" sent people looking inside it
        what = ("no config.json in" if directory.is_dir() else "a file, not a checkpoint directory:"
                if directory.exists() else "no such directory:")
        hub = (f" If {name!r} is a Hub id, it is not in the Hugging Face Hub cache either: download it where there "
               f"is internet (`hf download {name}` into the cache, or with `--local-dir DIR` and give DIR)."
               if not directory.exists() and _HUB_ID.fullmatch(name) else "")
        raise FileNotFoundError(
            f"model {name!r}: {what} {str(directory)!r}.{hub} Give a local Hugging Face checkpoint "
            f"directory, a Hub id already in the Hub cache, {EMBEDDED_MODEL_NAME!r}, or 'random:<preset>' "
            "(nothing is downloaded at run time).")
    try:
        cfg = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as e:  # transformers' "not a valid JSON file" is an OSError
        raise ValueError(f"model {name!r}: {str(directory / 'config.json')!r} could not be read as a model "
                         f"config: {e}") from None
    quant = getattr(cfg, "quantization_config", None)
    if quant:  # fp8, GPTQ, AWQ, ...: read as floats, its weights would give noise (their scales unused)
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        raise ValueError(
            f"model {name!r}: a pre-quantized checkpoint (config.json's quantization_config, quant_method="
            f"{method!r}) is not supported: minivllm loads float weights (float32, bfloat16 or float16) and "
            "quantizes them itself with quantization='int8'")
    tokenizer_dir = directory if _has_tokenizer(directory) else None
    return ModelSource(name, cfg, directory, tokenizer_dir, _eos_ids(directory, tokenizer_dir))


#: a Hugging Face Hub model id, ``org/name`` (a path that does not exist is tried as one)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _hub_cache_snapshot(repo_id: str) -> Path | None:
    """The Hugging Face Hub cache's snapshot of ``repo_id`` at its ``main`` revision (where
    ``hf download``, transformers or vLLM left it: ``$HF_HUB_CACHE``, by default
    ``~/.cache/huggingface/hub``), or None. ``local_files_only``: nothing is downloaded."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, an id the Hub would refuse, or no huggingface_hub
        return None


def _has_tokenizer(directory: Path) -> bool:
    return (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file()


def with_tokenizer(source: ModelSource, tokenizer: str | os.PathLike | None) -> ModelSource:
    """``source`` with ``LLM(tokenizer=...)`` applied: ``None`` or the model's own name -> ``source``
    itself; an embedded model's name -> its directory; else a local directory holding Hugging Face
    tokenizer files (``tokenizer.json`` or ``tokenizer_config.json``), or a Hub id whose snapshot in
    the Hugging Face Hub cache holds them (nothing is downloaded). The
    end-of-sequence ids follow the same rule as the model's own: its generation_config.json if it
    has one, else the given tokenizer's.

    Raises:
        FileNotFoundError: neither, naming the value; ``None`` for a checkpoint directory without
            tokenizer files (as vLLM, which would fail to load one there; naming the directory).
    """
    if tokenizer is not None and not str(tokenizer).strip():  # Path("") is the working directory
        raise ValueError(f"tokenizer={tokenizer!r}: empty; give a directory with the tokenizer's files, "
                         f"{EMBEDDED_MODEL_NAME!r}, or None for the model's own")
    if tokenizer is None or str(tokenizer) == source.name:
        if source.tokenizer_dir is None:
            raise FileNotFoundError(
                f"model {source.name!r}: no tokenizer.json or tokenizer_config.json in {str(source.checkpoint_dir)!r}. "
                "Copy the tokenizer the model was trained with there, or give LLM(tokenizer=<its directory>) "
                f"({EMBEDDED_MODEL_NAME!r} for the embedded model's).")
        return source
    directory = EMBEDDED_CHECKPOINTS.get(str(tokenizer)) or Path(tokenizer).expanduser()
    if not directory.exists() and _HUB_ID.fullmatch(str(tokenizer)):  # a Hub id: its cached snapshot, if any
        directory = _hub_cache_snapshot(str(tokenizer)) or directory
    if not _has_tokenizer(directory):
        raise FileNotFoundError(
            f"tokenizer {str(tokenizer)!r}: no tokenizer.json or tokenizer_config.json in {str(directory)!r}. Give a "
            f"local directory with a Hugging Face tokenizer, {EMBEDDED_MODEL_NAME!r}, or None for the model's own "
            "(nothing is downloaded at run time).")
    model_dir = source.checkpoint_dir or EMBEDDED_MODEL_DIR  # (random weights: the embedded generation config)
    return dataclasses.replace(source, tokenizer_dir=directory, eos_token_ids=_eos_ids(model_dir, directory))
