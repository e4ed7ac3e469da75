"""Packaged model configs (real shapes, no weights) for ``random:<preset>`` models.

Each preset is a directory ``minivllm/assets/configs/<name>/`` holding the model's
Hugging Face ``config.json``, copied from the published checkpoint.
"""
from __future__ import annotations

from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "assets" / "configs"
RANDOM_PREFIX = "random:"


def list_presets() -> list[str]:
    """Names of the packaged configs, sorted (e.g. ``["qwen3-0.6b", "qwen3-1.7b"]``)."""
    if not CONFIGS_DIR.is_dir():
        return []
    return sorted(p.name for p in CONFIGS_DIR.iterdir() if (p / "config.json").is_file())


def preset_dir(name: str) -> Path:
    """Directory of preset ``name`` (a leading ``"random:"`` is accepted and ignored).

    Raises:
        ValueError: unknown preset (the message lists the valid ones).
    """
    if not isinstance(name, str):
        raise ValueError(f"preset name must be a str, got {name!r}")
    key = name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name
    valid = list_presets()
    if key not in valid:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {valid}")
    return CONFIGS_DIR / key


def load_preset_config(name: str):
    """The preset's config as a ``transformers`` config object (via ``AutoConfig``).

    Raises:
        ValueError: unknown preset (the message lists the valid ones).
    """
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(preset_dir(name)))
