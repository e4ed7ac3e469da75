"""nano-vllm's example.py and bench.py call patterns (model path and sizes changed)."""
from __future__ import annotations

import time
from random import randint, seed

from minivllm import LLM, SamplingParams  # was: from nanovllm import LLM, SamplingParams
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

PATH = str(EMBEDDED_MODEL_DIR)  # was: os.path.expanduser("~/huggingface/Qwen3-0.6B/")


def test_example_py():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(PATH)
    llm = LLM(PATH, enforce_eager=True, tensor_parallel_size=1)
    sampling_params = SamplingParams(temperature=0.6, max_tokens=16)
    prompts = ["introduce yourself", "list all prime numbers within 100"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=True)
               for prompt in prompts]
    outputs = llm.generate(prompts, sampling_params)
    for prompt, output in zip(prompts, outputs):
        print(f"Prompt: {prompt!r}\nCompletion: {output['text']!r}")
        assert isinstance(output["text"], str) and 1 <= len(output["token_ids"]) <= 16
    llm.shutdown()


def test_bench_py():
    seed(0)
    num_seqs, max_input_len, max_output_len = 6, 48, 12  # was 256, 1024, 1024
    llm = LLM(PATH, enforce_eager=False, max_model_len=4096)  # above the model's 2048: capped, as nano-vllm does
    vocab = 4096  # was randint(0, 10000): Qwen3's vocabulary
    prompt_token_ids = [[randint(0, vocab - 1) for _ in range(randint(10, max_input_len))] for _ in range(num_seqs)]
    sampling_params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(4, max_output_len))
                       for _ in range(num_seqs)]
    llm.generate(["Benchmark: "], SamplingParams())  # warm-up
    t = time.time()
    outputs = llm.generate(prompt_token_ids, sampling_params, use_tqdm=False)
    t = time.time() - t
    total_tokens = sum(sp.max_tokens for sp in sampling_params)
    print(f"Total: {total_tokens}tok, Time: {t:.2f}s, Throughput: {total_tokens / t:.2f}tok/s")
    assert [len(o["token_ids"]) for o in outputs] == [sp.max_tokens for sp in sampling_params]
    assert llm.llm_engine.config.max_model_len == 2048
    llm.shutdown()
