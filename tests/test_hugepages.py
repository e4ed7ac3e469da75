"""The CPU KV pool asks Linux for 2 MiB pages (a hint: results never depend on it)."""
from __future__ import annotations

import logging

import pytest
import torch

from minivllm.engine.kv_cache import allocate_kv_cache
from minivllm.utils import hugepages


class _Cfg:
    num_key_value_heads, num_hidden_layers, head_dim, hidden_size, num_attention_heads = 2, 2, 64, 128, 2


def _huge_kb() -> int | None:
    try:
        text = open("/proc/self/smaps_rollup").read()
    except OSError:
        return None
    return int(text.split("AnonHugePages:")[1].split()[0]) if "AnonHugePages:" in text else None


def test_advise_huge_asks_only_for_whole_2mib_ranges_of_cpu_tensors():
    assert not hugepages.advise_huge(torch.empty(1000))  # smaller than one huge page
    big = torch.empty(3 * hugepages.HUGE_PAGE // 4)
    assert hugepages.advise_huge(big) == (hugepages.transparent_hugepage_mode() in ("madvise", "always"))
    assert not hugepages.advise_huge(torch.empty(3 * hugepages.HUGE_PAGE // 4, device="meta"))


def test_cpu_kv_pool_is_zeroed_and_says_which_pages_it_asked_for(caplog):
    with caplog.at_level(logging.INFO, logger="minivllm.engine.kv_cache"):
        cache, layers = allocate_kv_cache(_Cfg, 512, 16, torch.float32, torch.device("cpu"))  # 16 MiB
    assert cache.shape == (2, 2, 512, 16, 2, 64) and not cache.any()
    assert len(layers) == 2 and layers[1][0].data_ptr() == cache[0, 1].data_ptr()
    mode = hugepages.transparent_hugepage_mode()
    want = "2 MiB pages requested" if mode in ("madvise", "always") else "4 KiB pages"
    assert "CPU KV cache: 16 MiB, " + want in caplog.text


@pytest.mark.skipif(hugepages.transparent_hugepage_mode() not in ("madvise", "always") or _huge_kb() is None,
                    reason="transparent huge pages off (or /proc unreadable) here")
def test_the_advice_gives_huge_pages_where_the_kernel_has_them():
    before = _huge_kb()
    cache, _ = allocate_kv_cache(_Cfg, 1024, 16, torch.float32, torch.device("cpu"))  # 32 MiB
    after = _huge_kb()
    # a hint: a fragmented host may have no free 2 MiB pages, so this asks for one at least
    assert after - before >= 2048, (before, after)
    del cache
