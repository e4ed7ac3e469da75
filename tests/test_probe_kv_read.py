"""scripts/probe_kv_read.py: the decode step's KV laid out as the engine lays it out, for any context."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _probe():
    spec = importlib.util.spec_from_file_location("_probe_kv_read", ROOT / "scripts" / "probe_kv_read.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("context", [1, 15, 16, 40, 128, 129, 168])
def test_block_table_any_context(context):
    """A context shorter than the 128-token prompt raised a shape mismatch (the prompt's 8 blocks
    written into a row of fewer)."""
    probe = _probe()
    table = probe.block_table(3, context, 128)
    per_seq = -(-context // probe.BLOCK)
    assert table.shape == (3, per_seq)
    assert sorted(table.flatten().tolist()) == list(range(3 * per_seq))  # every block once
    first = -(-min(context, 128) // probe.BLOCK)
    for s in range(3):  # a prompt's blocks are together
        assert table[s, :first].tolist() == list(range(s * first, (s + 1) * first))


def test_block_table_refuses_empty():
    with pytest.raises(ValueError, match="context=0"):
        _probe().block_table(2, 0, 128)


def test_main_short_context(capsys):
    probe = _probe()
    from minivllm.layers.attention import cpu_decode
    if cpu_decode.load() is None:
        pytest.skip(f"decode kernel unavailable: {cpu_decode.unavailable_reason()}")
    threads = torch.get_num_threads()
    try:
        probe.main(["--seqs", "2", "--context", "40", "--steps", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "2 sequences x 40 keys" in out and "decode attention kernel" in out


def test_main_refuses_zero_context():
    with pytest.raises(SystemExit):
        _probe().main(["--context", "0"])
