"""Fill a model's parameters from a Hugging Face safetensors checkpoint, or at random.

Checkpoint layouts accepted: one ``model.safetensors``; several files listed in
``model.safetensors.index.json`` (``{"weight_map": {tensor_name: file_name}}``); or, failing
both, every ``*.safetensors`` file in the directory.

Tensor names: Hugging Face's (``model.layers.0.self_attn.q_proj.weight``), mapped to our
packed parameters through ``model.packed_modules_mapping`` (q/k/v -> ``qkv_proj`` with shard
``"q"``/``"k"``/``"v"``, gate/up -> ``gate_up_proj`` with shard 0/1); names that are already
ours (``...qkv_proj.weight``) load as the full packed tensor. Tensors are read one at a time
(``safetensors.safe_open``) and each parameter's ``weight_loader`` copies this rank's slice,
converting to the parameter's dtype and device.

Both entry points (:func:`load_weights`, :func:`init_random_weights`) end with
:func:`process_loaded_weights`: int8 quantisation when the model carries a ``quant_config``
(:func:`minivllm.quantization.quantize_model`), then
:func:`minivllm.layers.prepack.process_weights_after_loading` (the remaining CPU linears
packed once, here: panels for our GEMM, else oneDNN); both start by undoing that, so a model can be loaded again.
"""
from __future__ import annotations

import logging
import math
import zlib
from pathlib import Path

import torch
from torch import nn

from minivllm.layers.prepack import process_weights_after_loading, unpack_weights
from minivllm.utils import cdiv
from minivllm.utils.model_source import read_json_file
from minivllm.quantization.layer import quantize_model

logger = logging.getLogger(__name__)

_ALL = "__all__"  # marker: the whole (packed) parameter was loaded at once


def checkpoint_files(checkpoint_dir) -> list[Path]:
    """The safetensors files of a checkpoint directory, in load order.

    Raises:
        FileNotFoundError: the directory does not exist or holds no safetensors file
            (the message names the path, and any ``.bin``/``.pt``/``.gguf`` weights it holds instead).
        ValueError: a ``model.safetensors.index.json`` that does not parse or has no ``weight_map``
            (naming the file).
    """
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {str(path)!r}")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_file(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{str(index)!r} has no \"weight_map\" object of tensor name -> file name "
                             f"(got {type(weight_map).__name__}); copy or download it again")
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{str(index)!r} lists {f.name!r}, which does not exist in {str(path)!r}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = (f" ({', '.join(other[:3])}: PyTorch pickles and GGUF are not read; convert them once with "
                "transformers: from_pretrained(dir).save_pretrained(new_dir) writes safetensors)") if other else ""
        raise FileNotFoundError(f"no *.safetensors weights found in {str(path)!r}{hint}")
    return files


def process_loaded_weights(model: nn.Module) -> None:
    """What runs once the float weights are in place: int8 quantisation of the layers
    ``model.quant_config`` asks for (none without one), then packing (panels or oneDNN) of the CPU
    linears still in float. Undone by :func:`minivllm.layers.prepack.unpack_weights`."""
    quantize_model(model)
    process_weights_after_loading(model)


def _default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _packed_parts(model: nn.Module) -> dict[str, list[tuple[str, object]]]:
    """our packed module name -> [(checkpoint module name, shard id), ...]."""
    parts: dict[str, list[tuple[str, object]]] = {}
    for ckpt_name, (packed, shard) in getattr(model, "packed_modules_mapping", {}).items():
        parts.setdefault(packed, []).append((ckpt_name, shard))
    return parts


def _resolve(name: str, params: dict[str, nn.Parameter], mapping: dict) -> tuple[str, object] | None:
    """Checkpoint tensor name -> (our parameter name, shard id or None)."""
    if name in params:
        return name, None
    for ckpt_module, (packed, shard) in mapping.items():
        needle = f".{ckpt_module}."
        if needle in name:
            candidate = name.replace(needle, f".{packed}.")
            if candidate in params:
                return candidate, shard
    return None


def _tied_head_differs(directory: Path, source: dict[str, str], rows: int = 64) -> bool:
    """Whether a tied checkpoint's own ``lm_head.weight`` differs from its embedding (compared on
    their first ``rows`` rows: enough to tell a separate head, without reading a second vocabulary-sized
    tensor)."""
    from safetensors import safe_open

    names = ("lm_head.weight", "model.embed_tokens.weight")
    if not all(n in source for n in names):
        return False
    head, embed = [], []
    for n, out in zip(names, (head, embed)):
        with safe_open(str(directory / source[n]), framework="pt", device="cpu") as f:
            out.append(f.get_slice(n)[:rows])
    return head[0].shape != embed[0].shape or not torch.equal(head[0], embed[0])


def corrupt_file_error(file: Path, cause: Exception) -> ValueError:
    """The error for a safetensors file whose header or data cannot be read."""
    return ValueError(f"checkpoint file {str(file)!r} is corrupt or truncated (safetensors: {cause}); "
                      "copy or download it again")


@torch.no_grad()
def load_weights(model: nn.Module, checkpoint_dir) -> None:
    """Load every parameter of ``model`` from the safetensors checkpoint in ``checkpoint_dir``.

    With tied embeddings (``model.tie_word_embeddings``) a checkpoint ``lm_head.weight`` is
    not needed and, if present, ignored (the head shares ``embed_tokens.weight``). Tensors
    the model has no parameter for are skipped with a log line.

    Raises:
        FileNotFoundError: no checkpoint directory / no safetensors files (names the path).
        ValueError: tensors missing from the checkpoint (lists them by checkpoint name), a
            tensor in two files, a tensor whose shape does not match, or a safetensors file that cannot be read
            (truncated or corrupt: names the file; chained from safetensors' error).
    """
    files = checkpoint_files(checkpoint_dir)
    from safetensors import SafetensorError, safe_open

    unpack_weights(model)
    params = dict(model.named_parameters())  # tied lm_head.weight appears once, as embed_tokens
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(model, "tie_word_embeddings", False))
    loaded: dict[str, set] = {}
    unexpected: list[str] = []
    source: dict[str, str] = {}  # tensor name -> the file it came from
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except SafetensorError as e:
            raise corrupt_file_error(file, e) from e
        with handle as f:
            for name in f.keys():
                if name in source:  # e.g. a full model.safetensors left beside its shards, no index to choose
                    raise ValueError(f"checkpoint {str(checkpoint_dir)!r}: tensor {name!r} is in both {source[name]!r} "
                                     f"and {file.name!r}; remove the stale file (or add the index that lists the "
                                     "files to load)")
                source[name] = file.name
                target = _resolve(name, params, mapping)
                if target is None:
                    if not (tied and name == "lm_head.weight"):
                        unexpected.append(name)
                    continue
                pname, shard = target
                param = params[pname]
                loader = getattr(param, "weight_loader", _default_loader)
                try:
                    tensor = f.get_tensor(name)
                except SafetensorError as e:
                    raise corrupt_file_error(file, e) from e
                try:
                    if shard is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"{name} (from {file.name}): {e}") from None
                loaded.setdefault(pname, set()).add(_ALL if shard is None else shard)
    if tied and _tied_head_differs(files[0].parent, source):
        logger.warning("checkpoint %r: config.json says tie_word_embeddings=true, yet its lm_head.weight differs "
                       "from model.embed_tokens.weight; the LM head is the embedding, as in vLLM (transformers may "
                       "keep the separate head: set tie_word_embeddings=false to use it)", str(checkpoint_dir))
    if unexpected:
        logger.warning("ignored %d checkpoint tensors the model does not use: %s%s", len(unexpected),
                       unexpected[:10], " ..." if len(unexpected) > 10 else "")

    parts = _packed_parts(model)
    missing: list[str] = []
    for pname in params:
        got = loaded.get(pname, set())
        if _ALL in got:
            continue
        module_path, _, leaf = pname.rpartition(".")
        owner, _, module = module_path.rpartition(".")
        if module in parts:
            for ckpt_module, shard in parts[module]:
                if shard not in got:
                    missing.append(f"{owner}.{ckpt_module}.{leaf}")
        elif not got:
            missing.append("lm_head.weight" if pname == "lm_head.weight" else pname)
    if missing:
        shown = ", ".join(missing[:20]) + (f" ... ({len(missing)} in all)" if len(missing) > 20 else "")
        raise ValueError(f"checkpoint {str(checkpoint_dir)!r} is missing tensors: {shown}")
    process_loaded_weights(model)


# Random models for the course are large (Qwen3-0.6B: 596M parameters) and drawing that
# many normals takes ~10 s on a laptop CPU. Tensors larger than _FRESH_MAX elements are
# therefore windows of one pool of normals (of odd length, so rows do not line up).
_POOL_SIZE = (1 << 22) + 1
_FRESH_MAX = 1 << 16


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
    """Deterministic random weights, for ``random:<preset>`` models (real shapes, no checkpoint).

    Norm weights are ``1 + 0.05 * z``; every other weight and bias is ``0.02 * z`` (the usual
    ``initializer_range``), with ``z`` standard normal. Each parameter has its own generator
    seeded from ``(seed, parameter name)``, so values do not depend on parameter order.
    Tensors of up to ``2**16`` elements get fresh normals; larger ones are a window, at a
    random offset, of one shared pool of ``2**22 + 1`` normals repeated, which makes building
    a 0.6B model several times faster (no per-element sampling, one copy per tensor); the
    values are still N(0, 0.02^2) marginally, just not independent. Values are drawn at the FULL (unsharded) shape and
    passed through the parameter's ``weight_loader``, so every tensor-parallel size builds
    the same model.

    Raises:
        ValueError: a ``seed`` that is not an int, or a norm weight too large to fill (naming it).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    unpack_weights(model)
    # Everything is drawn on the CPU (explicit device: callers may hold a torch.device context).
    pool32 = 0.02 * torch.randn(_POOL_SIZE, generator=torch.Generator().manual_seed(seed % (2**63)),
                                device="cpu")
    params = list(model.named_parameters())
    shapes = {name: tuple(getattr(p, "full_shape", p.shape)) for name, p in params}
    largest = max((math.prod(s) for s in shapes.values()), default=0)
    # The pool repeated to cover the largest tensor at any offset, once per dtype, so each
    # large tensor is a view of it (one copy, into the parameter, per tensor).
    extended: dict[torch.dtype, torch.Tensor] = {}
    for name, param in params:
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        shape = shapes[name]
        numel = math.prod(shape)
        if numel <= _FRESH_MAX:
            z = torch.randn(shape, generator=gen, device="cpu")
            values = 1.0 + 0.05 * z if name.endswith("norm.weight") else 0.02 * z
        else:
            if name.endswith("norm.weight"):
                raise ValueError(f"norm weight {name} has {numel} elements; the pool is for matrices")
            if param.dtype not in extended:
                reps = cdiv(largest + _POOL_SIZE, _POOL_SIZE)
                extended[param.dtype] = pool32.to(param.dtype).repeat(reps)
            offset = int(torch.randint(0, _POOL_SIZE, (1,), generator=gen, device="cpu"))
            values = extended[param.dtype][offset:offset + numel].view(shape)
        getattr(param, "weight_loader", _default_loader)(param, values)
    process_loaded_weights(model)
