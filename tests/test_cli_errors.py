"""The command line as a user meets it going wrong: Ctrl-C, a closed pipe, a request that ends in an
error, broken checkpoint files, odd arguments. Each was a Python traceback (or a silent misuse)
before; now a line saying what happened and an exit status a shell can test."""
from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest

from minivllm import bench
from minivllm.__main__ import main
from minivllm.bench import cli as bench_cli
from minivllm.bench import common as bench_common
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

QUIET = ["--threads", "1", "--max-tokens", "4"]


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # generate sets torch's thread count for its process


def test_generate_ctrl_c_ends_the_line_says_so_and_shuts_the_engine_down(monkeypatch, capsys):
    from minivllm import LLM

    engines = []
    original = LLM.stream

    def stream_then_interrupt(self, *args, **kwargs):
        engines.append(self)
        for out in original(self, *args, **kwargs):
            yield out
            raise KeyboardInterrupt  # the learner's Ctrl-C, mid-completion

    monkeypatch.setattr(LLM, "stream", stream_then_interrupt)
    assert main(["generate", "The list type", *QUIET]) == 130
    out, err = capsys.readouterr()
    assert out.startswith("The list type") and out.endswith("\n")
    assert err.rstrip().endswith("interrupted") and "Traceback" not in err
    with pytest.raises(RuntimeError, match="shut down"):
        engines[0].generate("more")


def test_generate_request_ending_in_an_error_prints_it_and_fails(capsys):
    """No token could be drawn (a penalty that overflows every logit): TTFT is None, whose formatting
    raised a TypeError after the run; the error's message was never shown and the status was 0."""
    assert main(["generate", "The list type", *QUIET, "--repetition-penalty", "1e-45"]) == 1
    err = capsys.readouterr().err
    assert "# 0 tokens (error); TTFT n/a" in err
    assert "error: request '0': no token could be sampled" in err


def test_generate_into_a_closed_pipe_stops_quietly(tmp_path):
    cmd = [sys.executable, "-m", "minivllm", "generate", "The list type", "--threads", "1", "--max-tokens", "400",
           "--ignore-eos"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                            env={**_env(), "MINIVLLM_LOGGING_LEVEL": "WARNING"})
    assert proc.stdout.read(20)  # like `| head -c 20`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_bench_into_a_closed_pipe_stops_quietly(tmp_path):
    cmd = [sys.executable, "-m", "minivllm", "bench", "--threads", "1", "--no-peers", "--num-requests", "2",
           "--input-len", "2", "2", "--output-len", "2", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                            env={**_env(), "MINIVLLM_LOGGING_LEVEL": "WARNING"})
    assert proc.stdout.readline()  # like `| head -1`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "MINIVLLM_MODEL"}


def test_generate_refuses_a_prompt_that_is_not_utf8(capsys):
    assert main(["generate", "caf\udcff", *QUIET]) == 2
    assert "error: the prompt 'caf\\udcff' is not valid UTF-8 text" in capsys.readouterr().err


@pytest.mark.parametrize("broken,text", [
    ("config.json", "{not json"), ("generation_config.json", "{not json"), ("tokenizer_config.json", "{not json"),
    ("generation_config.json", "[1, 2]"),  # valid JSON of the wrong shape: an AttributeError traceback
    ("tokenizer.json", '{"version": "1.0", "model": {"type": "BPE"}}'),  # transformers' own KeyError
])
def test_a_checkpoint_file_that_is_not_json_is_named(broken, text, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL_DIR, model)
    (model / broken).write_text(text)
    assert main(["generate", "hi", "--model", str(model), *QUIET]) == 2
    err = capsys.readouterr().err
    named = str(model / broken) if broken != "tokenizer.json" else f"the tokenizer in {str(model)!r}"
    assert "\nerror: " in err and named in err and "Traceback" not in err
    assert bench.main(["--model", str(model), "--no-peers", "--num-requests", "2", "--threads", "1"]) == 2
    assert named in capsys.readouterr().err


def test_generate_truncates_a_long_prompt_and_takes_max_model_len(capsys):
    """The too-long-prompt error suggested `truncate_prompt_tokens` and a larger max_model_len, which
    generate had no option for."""
    long_prompt = " ".join(["def"] * 2100)
    assert main(["generate", long_prompt, *QUIET]) == 2
    err = capsys.readouterr().err
    # the fixes as this command's options, not as Python arguments; no "prompt 0" for its one prompt
    assert "\nerror: prompt of " in err and "leaves no room to generate" in err
    # max_model_len is already the model's 2048 positions: a larger one is no fix (it was suggested)
    assert "--truncate-prompt-tokens N" in err and "or a model with more positions" in err and "SamplingParams(" not in err
    assert main(["generate", " ".join(["def"] * 600), *QUIET, "--max-model-len", "512"]) == 2
    assert "or a --max-model-len of at least 601)" in capsys.readouterr().err
    assert main(["generate", long_prompt, *QUIET, "--truncate-prompt-tokens", "100"]) == 0
    out, err = capsys.readouterr()
    assert "# 4 tokens (length)" in err and "the prompt was cut to its last 100 of " in err
    assert out.count("def") < 110  # the prompt the model saw, not the 2,100 words given
    assert main(["generate", "The list type", *QUIET, "--max-model-len", "6"]) == 0
    assert "# 3 tokens (length)" in capsys.readouterr().err  # 6 tokens of model length leave room for 3
    assert main(["generate", "hi", *QUIET, "--max-model-len", "0"]) == 2
    assert "error: --max-model-len: max_model_len=0" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--scale", "inf"], "--scale inf: must be a positive, finite number"),
    (["--scale", "nan"], "--scale nan: must be a positive, finite number"),
    (["--num-requests", "0"], "--num-requests=0: must be at least 1"),
])
def test_bench_names_a_bad_workload_flag(args, message, capsys):
    assert bench.main(["--no-peers", "--threads", "1", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--num-speculative-tokens", "-5", "--speculative", "ngram"], "--num-speculative-tokens=-5: must be at least 1"),
    (["--sweep", "--prompt-lens", "-3"], "--prompt-lens -3: each must be at least 1"),
    (["--num-speculative-tokens", "3"], "--num-speculative-tokens 3: only --speculative reads it"),
    (["--context-len", "64"], "--context-len 64: only --sweep reads it"),
    (["--draft-model", "/nonexistent"], "--draft-model '/nonexistent': only --speculative reads it"),
    (["--speculative", "ngram", "--draft-model", "x"], "--draft-model 'x': only --speculative draft reads it"),
    (["--nanovllm-script", "/nonexistent"], "--nanovllm-script '/nonexistent': only --overhead reads it"),
    (["--sweep", "--scale", "5"], "--scale 5.0: only the throughput run (no mode flag) reads it"),
    (["--overhead", "--num-requests", "3"], "--num-requests 3: only the throughput run (no mode flag) reads it"),
    (["--decode-steps", "5"], "--decode-steps 5: only --sweep / --overhead / --speculative / --quantization reads it"),
    (["--batch-sizes", "1", "4"], "--batch-sizes 1 4: only --sweep / --overhead / --speculative reads it"),
    (["--no-nanovllm"], "--no-nanovllm: only --overhead reads it"),
])
def test_bench_refuses_a_flag_no_running_mode_reads(args, message, capsys):
    """Each of these exited 0 after minutes of measuring something else, the flag ignored."""
    assert bench.main(["--no-peers", "--threads", "1", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_refuses_an_output_length_the_model_cannot_hold(tmp_path, capsys):
    """--output-len 2000 2100 ran the whole benchmark, then failed on 'minivllm produced 4080 tokens, the
    workload asked for 4130' with a traceback: such requests end at max_model_len."""
    from minivllm.bench.workload import make_workload

    with pytest.raises(ValueError, match=r"output_len=\(2000, 2100\): an output of \d+ tokens was drawn.*"
                                         r"max_model_len=2048"):
        make_workload("cpu", 4096, num_requests=2, input_len=(1, 1), output_len=(2000, 2100), max_model_len=2048)
    with pytest.raises(ValueError, match=r"the 'nano' workload's output lengths \(100, 1024\): an output of 1024"):
        make_workload("nano", 151936, max_model_len=1024)  # seed 0 draws one 1024-token output (nano-vllm's own)
    assert max(make_workload("cpu", 4096, num_requests=8, output_len=(1000, 2047), max_model_len=2048).output_lens) <= 2047


def test_bench_kv_pool_holds_the_running_requests_not_all_of_them(monkeypatch):
    """--num-requests 20000 sized the pool for every request at once (an mmap of ~30 GB failed)."""
    from minivllm.bench import throughput

    asked = {}

    def stop(model, **engine_args):
        asked.update(engine_args)
        raise KeyboardInterrupt

    monkeypatch.setattr(throughput, "build_llm", stop)
    for n, seqs in ((20000, None), (20000, 8), (3, None)):
        with pytest.raises(KeyboardInterrupt):
            throughput.run_throughput(None, num_requests=n, peers=(), **({"max_num_seqs": seqs} if seqs else {}))
        running = min(n, seqs or 256)
        assert asked["kv_cache_memory_bytes"] == bench_common.kv_bytes_for(None, running * (256 + 128), None)
    assert math.isfinite(asked["kv_cache_memory_bytes"])


def test_bench_passes_rounds_to_speculative(monkeypatch):
    from minivllm.bench import speculative

    seen = {}

    def fake(model, **kw):
        seen.update(kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(speculative, "run_speculative", fake)
    assert bench.main(["--speculative", "ngram", "--rounds", "7", "--threads", "1"]) == 130
    assert seen["rounds"] == 7


def test_bench_ctrl_c_says_interrupted(monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "run_cli", lambda argv: (_ for _ in ()).throw(KeyboardInterrupt))
    assert bench.main([]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted"


def test_model_help_names_the_environment_default():
    from minivllm.__main__ import build_generate_parser

    for parser in (build_generate_parser(), bench_cli.build_parser()):
        text = " ".join(parser.format_help().split())
        assert "$MINIVLLM_MODEL if set" in text


def test_workload_scale_must_be_finite():
    from minivllm.bench.workload import make_workload

    for bad in (float("inf"), float("nan"), 0, -1, True):
        with pytest.raises(ValueError, match="scale=.*positive, finite"):
            make_workload(scale=bad)
    assert make_workload(scale=0.5).num_requests == 16


def test_generate_banner_says_when_our_c_kernels_serve_the_torch_backend(capsys, monkeypatch):
    """The banner said attention=torch while the start-up log said the CPU decode ran in our C kernel."""
    assert main(["generate", "The list type", *QUIET]) == 0
    assert " attention=torch+C (loaded in " in capsys.readouterr().err
    monkeypatch.setenv("MINIVLLM_CPU_DECODE_KERNEL", "0")  # the kernels off: the torch backend's SDPA paths
    assert main(["generate", "The list type", *QUIET]) == 0
    assert " attention=torch (loaded in " in capsys.readouterr().err


def test_an_empty_model_name_and_a_kv_budget_below_one_block_are_named():
    """LLM("") reported "no config.json in '.'" (the working directory), and a KV budget below one block
    did not name kv_cache_memory_bytes."""
    from minivllm import LLM

    with pytest.raises(ValueError, match="model='': empty"):
        LLM("")
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1000: too small for one block of 16 tokens \(\d+ "):
        LLM("minivllm-tiny", kv_cache_memory_bytes=1000)
