"""vLLM's offline example scripts' call patterns (import line, model path and sizes changed)."""
from __future__ import annotations

import time

from minivllm import LLM, EngineArgs, LLMEngine, RequestOutput, SamplingParams  # was: from vllm import ...
from minivllm.utils.argparse_utils import FlexibleArgumentParser  # was: from vllm.utils.argparse_utils import ...
from minivllm.utils.model_source import EMBEDDED_MODEL_DIR

MODEL = str(EMBEDDED_MODEL_DIR)  # was: "facebook/opt-125m", "meta-llama/Llama-3.2-1B-Instruct", ...


def test_basic_py():
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(model=MODEL)
    outputs = llm.generate(prompts, sampling_params)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}\nOutput:    {generated_text!r}\n" + "-" * 60)
    assert [o.prompt for o in outputs] == prompts
    llm.shutdown()


def test_generate_py():
    # basic/generate.py: engine arguments from the command line through EngineArgs.add_cli_args,
    # sampling arguments set on the model's default sampling params.
    parser = FlexibleArgumentParser()
    engine_group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(engine_group)
    engine_group.set_defaults(model=MODEL)
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    args: dict = vars(parser.parse_args(["--max-tokens", "12", "--temperature", "0.7", "--top_p", "0.9",
                                         "--top-k=20", "--max_num_seqs", "4", "--no-enable-prefix-caching",
                                         "--trust-remote-code", "--disable-log-stats"]))
    max_tokens, temperature = args.pop("max_tokens"), args.pop("temperature")
    top_p, top_k = args.pop("top_p"), args.pop("top_k")
    llm = LLM(**args)
    assert llm.llm_engine.args.max_num_seqs == 4 and not llm.llm_engine.args.enable_prefix_caching
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    if top_p is not None:
        sampling_params.top_p = top_p
    if top_k is not None:
        sampling_params.top_k = top_k
    prompts = ["Hello, my name is", "The capital of France is"]
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}")
        assert 1 <= len(output.outputs[0].token_ids) <= 12
    llm.shutdown()


def test_chat_py(tmp_path):
    llm = LLM(model=MODEL)
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens = 10

    def print_outputs(outputs):
        for output in outputs:
            print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}\n" + "-" * 80)

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)
    conversations = [conversation for _ in range(4)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    print_outputs(outputs)
    assert len(outputs) == 4
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=template.read_text())
    print_outputs(outputs)
    assert outputs[0].prompt.startswith("system: You are a helpful assistant\n")
    llm.shutdown()


LONG_PROMPT = ("You are a helpful assistant in recognizes the content of tables in markdown format. "
               "Here is a table as follows.\n# Table\n" + "".join(
                   f"| {i} | name{i} | {20 + i % 30} | job{i % 7} | address {i} street |\n" for i in range(12)))


def test_automatic_prefix_caching_py():
    def get_generation_time(llm, sampling_params, prompts):
        start_time = time.time()
        output = llm.generate(prompts, sampling_params=sampling_params)
        end_time = time.time()
        print(f"Output: {output[0].outputs[0].text}")
        print(f"Generation time: {end_time - start_time} seconds.")
        return output

    llm = LLM(model=MODEL, enable_prefix_caching=True)
    sampling_params = SamplingParams(temperature=0, max_tokens=8)
    first = get_generation_time(llm, sampling_params,
                                LONG_PROMPT + "Question: what is the age of name3? Your answer: The age of name3 is ")
    second = get_generation_time(llm, sampling_params,
                                 LONG_PROMPT + "Question: what is the job of name5? Your answer: The job of name5 is ")
    assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens > 0
    llm.shutdown()


def test_llm_engine_example_py():
    def create_test_prompts() -> list[tuple[str, SamplingParams]]:
        return [
            ("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1,
                                                                   max_tokens=8)),
            ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=8)),
            ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1,
                                                            max_tokens=8)),
        ]

    def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]):
        request_id, finished = 0, []
        while test_prompts or engine.has_unfinished_requests():
            if test_prompts:
                prompt, sampling_params = test_prompts.pop(0)
                engine.add_request(str(request_id), prompt, sampling_params)
                request_id += 1
            request_outputs: list[RequestOutput] = engine.step()
            for request_output in request_outputs:
                if request_output.finished:
                    print(request_output)
                    finished.append(request_output)
        return finished

    def initialize_engine(args) -> LLMEngine:
        engine_args = EngineArgs.from_cli_args(args)
        return LLMEngine.from_engine_args(engine_args)

    parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
    parser = EngineArgs.add_cli_args(parser)
    engine = initialize_engine(parser.parse_args(["--model", MODEL]))
    finished = process_requests(engine, create_test_prompts())
    by_id = {o.request_id: o for o in finished}
    assert sorted(by_id) == ["0", "1", "2"]
    assert by_id["0"].prompt_logprobs[0] is None and len(by_id["0"].outputs[0].logprobs) >= 1
    # n=2 under the default cumulative outputs: as vLLM streams them, the finished output is the last
    # sample's (vllm/v1/engine/parallel_sampling.py, ParentRequest.get_outputs)
    assert len(by_id["2"].outputs) == 1 and by_id["2"].outputs[0].index in (0, 1)
    engine.shutdown()
