"""The CPU KV pool asks Linux for 2 MiB pages (a hint: results never depend on it)."""
from __future__ import annotations

import logging

import pytest
import torch

from minivllm.engine.kv_cache import allocate_kv_cache
from minivllm.utils import hugepages


class _Cfg:
    num_key_value_heads, num_hidden_layers, head_dim, hidden_size, num_attention_heads = 2, 2, 64, 128, 2


def _proc_kib(path: str, field: str) -> int | None:
    """A ``field: N kB`` line's N in ``path`` (a /proc file of this process), None if unreadable."""
    try:
        text = open(path).read()
    except OSError:
        return None
    return int(text.split(field + ":")[1].split()[0]) if field + ":" in text else None


def _huge_kb() -> int | None:
    return _proc_kib("/proc/self/smaps_rollup", "AnonHugePages")


def test_advise_huge_asks_only_for_whole_2mib_ranges_of_cpu_tensors():
    assert not hugepages.advise_huge(torch.empty(1000))  # smaller than one huge page
    big = torch.empty(3 * hugepages.HUGE_PAGE // 4)
    assert hugepages.advise_huge(big) == (hugepages.transparent_hugepage_mode() in ("madvise", "always"))
    assert not hugepages.advise_huge(torch.empty(3 * hugepages.HUGE_PAGE // 4, device="meta"))


def test_advise_huge_asks_for_the_tensors_own_bytes_not_its_whole_storage(monkeypatch):
    """A tensor from zeroed_cpu_tensor sits in a mapping with up to 2 MiB to spare, and a view in a larger
    storage: 2 MiB pages are asked for under the tensor's own elements only (asking for the storage's gave a
    3 MiB weight 4 MiB of pages)."""
    asked = []
    monkeypatch.setattr(hugepages, "transparent_hugepage_mode", lambda: "madvise")
    monkeypatch.setattr(hugepages, "_madvise", lambda: lambda start, length, advice: asked.append((start, length)) or 0)
    big = torch.empty(5 * hugepages.HUGE_PAGE // 4)  # 5 MiB of float32
    start = -(-big.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE  # the first 2 MiB boundary inside it
    view = big[(start - big.data_ptr()) // 4:][:3 * hugepages.HUGE_PAGE // 2 // 4]  # 3 MiB from that boundary
    assert hugepages.advise_huge(view) and asked == [(start, hugepages.HUGE_PAGE)]
    asked.clear()
    assert not hugepages.advise_huge(big[:1000]) and asked == []  # a small view of a large storage: nothing asked
    strided = big[(start - big.data_ptr()) // 4:].view(-1, 2)[: hugepages.HUGE_PAGE // 8, 0]  # every other float
    assert hugepages.advise_huge(strided) is False and asked == []  # spans 2 MiB less one float: no whole page


def test_cpu_kv_pool_is_zeroed_and_says_which_pages_it_asked_for(caplog):
    with caplog.at_level(logging.INFO, logger="minivllm.engine.kv_cache"):
        cache, layers = allocate_kv_cache(_Cfg, 512, 16, torch.float32, torch.device("cpu"))  # 16 MiB
    assert cache.shape == (2, 2, 512, 16, 2, 64) and not cache.any()
    assert len(layers) == 2 and layers[1][0].data_ptr() == cache[0, 1].data_ptr()
    mode = hugepages.transparent_hugepage_mode()
    want = "2 MiB pages requested" if mode in ("madvise", "always") else "4 KiB pages"
    assert "CPU KV cache: 16 MiB, " + want in caplog.text


def _smaps_field(address: int, field: str) -> str | None:
    """The value of ``field`` (e.g. ``THPeligible``) of the mapping holding ``address``
    (/proc/self/smaps), None if unreadable or absent."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith(field + ":"):
            return line.split()[1]
    return None


def _thp_eligible(address: int) -> bool | None:
    value = _smaps_field(address, "THPeligible")
    return None if value is None else value == "1"


def _resident_kib() -> int | None:
    return _proc_kib("/proc/self/status", "VmRSS")  # this process's resident memory


@pytest.mark.skipif(_resident_kib() is None, reason="no /proc/self/status here")
def test_the_kv_pool_is_not_written_when_it_is_made():
    """The pool's zeros are the operating system's (an anonymous mapping): making a 256 MiB pool
    writes none of it, so an engine starts without zeroing a pool it mostly never uses (the
    default 512 MiB made a process's first engine take 1.8 s to build on the dev EPYC)."""
    before = _resident_kib()
    cache, layers = allocate_kv_cache(_Cfg, 8192, 16, torch.float32, torch.device("cpu"))  # 256 MiB
    grown = _resident_kib() - before
    assert grown < 64 * 1024, f"the process grew by {grown} KiB making a 256 MiB pool"
    layers[1][1][100].fill_(1.0)  # written through a layer's view: a page is made, the rest stays zero
    assert cache.sum().item() == 16 * 2 * 64 and cache.data_ptr() % hugepages.HUGE_PAGE == 0
    del cache, layers


@pytest.mark.skipif(hugepages.transparent_hugepage_mode() not in ("madvise", "always") or _huge_kb() is None,
                    reason="transparent huge pages off (or /proc unreadable) here")
def test_the_kv_pool_is_eligible_for_huge_pages_where_the_kernel_has_them():
    """The advice is what the engine controls: the pool's mapping is eligible for 2 MiB pages. Whether
    the kernel finds free 2 MiB pages at that moment depends on the host (CI once saw none granted on a
    fragmented host, so the pages themselves are not asserted)."""
    cache, _ = allocate_kv_cache(_Cfg, 1024, 16, torch.float32, torch.device("cpu"))  # 32 MiB
    inside = -(-cache.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE  # an aligned 2 MiB range's start
    eligible = _thp_eligible(inside)
    if eligible is None:
        pytest.skip("this kernel's /proc/self/smaps has no THPeligible field")
    assert eligible
    del cache


@pytest.mark.skipif(hugepages.transparent_hugepage_mode() not in ("madvise", "always") or _huge_kb() is None,
                    reason="transparent huge pages off (or /proc unreadable) here")
def test_weight_panels_of_2mib_or_more_are_eligible_for_huge_pages():
    """A decode step streams every weight: the panel GEMM's panels of 2 MiB or more start on a 2 MiB
    boundary in a mapping eligible for 2 MiB pages (same values); smaller ones stay ordinary tensors."""
    from minivllm.layers import cpu_gemm

    g = torch.Generator().manual_seed(0)
    for src, dtype in ((torch.randn(1024, 640, generator=g), torch.float32),  # 2.5 MiB each
                       (torch.randint(-127, 128, (4096, 640), generator=g, dtype=torch.int8), torch.int8)):
        panels = cpu_gemm.pack_panels(src, dtype)
        assert panels.data_ptr() % hugepages.HUGE_PAGE == 0 and torch.equal(cpu_gemm.unpack_panels(panels), src.float())
        eligible = _thp_eligible(panels.data_ptr())
        if eligible is None:
            pytest.skip("this kernel's /proc/self/smaps has no THPeligible field")
        assert eligible
    small = cpu_gemm.pack_panels(torch.randn(64, 8))
    assert small.untyped_storage().nbytes() == 64 * 8 * 4
