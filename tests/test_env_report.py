"""minivllm.utils.env_report: the largest cache size Linux reports, and what a chart says it measured."""
from minivllm.utils.env_report import last_level_cache_bytes


def _index(root, name, size):
    d = root / name
    d.mkdir()
    if size is not None:
        (d / "size").write_text(size + "\n")


def test_largest_reported_cache_in_bytes(tmp_path):
    for name, size in (("index0", "48K"), ("index1", "32K"), ("index2", "2048K"), ("index3", "266240K"),
                       ("index4", None), ("index5", "garbled")):
        _index(tmp_path, name, size)
    assert last_level_cache_bytes(str(tmp_path)) == 266240 * 1024  # 260 MiB, as a 2-core Xeon VM reports it


def test_suffixes_and_plain_bytes(tmp_path):
    _index(tmp_path, "index0", "1M")
    _index(tmp_path, "index1", "4194304")
    assert last_level_cache_bytes(str(tmp_path)) == 4 << 20
    _index(tmp_path, "index2", "1G")
    assert last_level_cache_bytes(str(tmp_path)) == 1 << 30


def test_none_without_sysfs(tmp_path):
    assert last_level_cache_bytes(str(tmp_path / "absent")) is None
    assert last_level_cache_bytes(str(tmp_path)) is None  # a directory with no index*/size in it


def test_chart_provenance_names_tensor_parallelism():
    # a chart of the two-process engine read like the single process's (a reader's review of chapter 10)
    from types import SimpleNamespace

    import torch

    from minivllm.utils.env_report import chart_provenance

    def engine(tp):
        cfg = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32,
                              args=SimpleNamespace(tensor_parallel_size=tp))
        return SimpleNamespace(config=cfg, source=SimpleNamespace(name="minivllm-tiny"))

    assert "· tensor_parallel_size=2 ·" in chart_provenance(engine(2), threads=1)
    assert "tensor_parallel" not in chart_provenance(engine(1), threads=1)
