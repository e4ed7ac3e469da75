"""``LLM``: the offline facade (vLLM's shape): generate, stream, chat."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import numbers
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence as Seq

from minivllm.chat import load_chat_template, text_messages, unused_template_variables
from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine, refuse_lora
from minivllm.exceptions import VLLMValidationError
from minivllm.inputs import cache_salt_of, check_tokenization_kwargs, prompt_truncation
from minivllm.logger import init_logger
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import NO_BEAM_SEARCH, SamplingParams
from minivllm.utils.gc_heap import caller_froze_heap, heap_frozen

logger = init_logger(__name__)


def _as_prompt_list(prompts) -> list:
    """One prompt (str, list[int], dict) or a list of them -> a list of prompts.

    A flat list that starts with a number is one prompt of token ids, so every element must
    then be an integer (``int`` or a numpy integer): ``[5, 2.0, 7]`` is a malformed prompt, not
    three prompts; one that starts with a prompt and holds a number is a list of prompts with a
    stray number. A 1-D numpy array or pandas Series is taken as the list of its elements, as
    vLLM iterates it.

    Raises:
        ValueError: a non-int in a token-id prompt (naming the element and its index), a
            list that starts with a prompt (str, dict, list) and holds a bare number (naming it), or
            ``prompts`` of another type.
    """
    if isinstance(prompts, (str, Mapping)):  # (a BatchEncoding too: encode_prompt says what to pass)
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if any(isinstance(t, numbers.Number) for t in prompts):  # bool is a Number too
            if isinstance(prompts[0], (str, dict, list, tuple)):  # ["hello", 5]: the number is the odd one out
                i = next(i for i, t in enumerate(prompts) if isinstance(t, numbers.Number))
                raise VLLMValidationError(f"prompts mix prompts (element 0: {type(prompts[0]).__name__}) with a bare "
                                          f"number (element {i}: {prompts[i]!r}); a token-id prompt is one list of ints, "
                                          "e.g. [[5, 7]] or {'prompt_token_ids': [5, 7]}")
            for i, t in enumerate(prompts):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise VLLMValidationError(f"prompt token ids: element {i} is {t!r} ({type(t).__name__}), "
                                              "not an int token id")
            return [[int(t) for t in prompts]]  # a single prompt of token ids (numpy ints as ints)
        return list(prompts)
    if type(prompts).__module__.split(".")[0] in ("numpy", "pandas") and getattr(prompts, "ndim", None) == 1:
        # a 1-D array or Series; np.str_ as a plain str, numpy integers stay (the list rule takes them)
        return _as_prompt_list([str(p) if isinstance(p, str) else p for p in prompts])
    hint = (" (a generator or other iterable is not taken, as in vLLM: pass list(...) of it)"
            if hasattr(prompts, "__iter__") else "")
    raise VLLMValidationError(f"prompts {prompts!r}: expected a str, list[int], dict, or a list of them{hint}")


#: nano-vllm's engine calls on its LLM -> what does it here
_NANO_ENGINE_CALLS = {
    "add_request": "llm.llm_engine.add_request(request_id, prompt, params)",
    "step": "llm.llm_engine.step() (it returns a list of RequestOutputs, not nano-vllm's (outputs, num_tokens): the "
            "step's token counts are llm.llm_engine.last_step_record.num_prefill_tokens / num_decode_tokens, or "
            "step_with_record() returns both)",
    "is_finished": "use `not llm.llm_engine.has_unfinished_requests()`",
    "exit": "llm.shutdown() (on the LLM) frees it",
}
#: vLLM's calls for pooling (embedding, classification, scoring) models and its metrics API
_VLLM_LACKING_CALLS = {
    **{name: "a pooling model's call (embeddings, classification, scores): minivllm serves generative models"
       for name in ("embed", "encode", "classify", "score", "reward")},
    "get_metrics": "vLLM's Prometheus metrics; minivllm measures each request (RequestOutput.metrics: ttft_ms, "
                   "tpot_ms, num_preemptions, and speculative decoding's num_draft_tokens, num_accepted_draft_tokens "
                   "and num_spec_steps, which vLLM's vllm:spec_decode_* counters sum over requests) and each step "
                   "(llm.llm_engine.last_step_record)",
    **{name: "vLLM's sleep mode (offloading weights and freeing the KV cache between uses); here llm.shutdown() "
             "frees the engine, and a new LLM(...) loads it again" for name in ("sleep", "wake_up", "is_sleeping")},
    **{name: "vLLM's calls into its worker processes; here the model is in this process: "
             "llm.llm_engine.runner.model (with tensor parallelism, rank 0's shard)"
       for name in ("collective_rpc", "apply_model")},
    "release_kv_cache_memory": "part of vLLM's sleep mode; here llm.shutdown() frees the KV cache with the engine",
    "reset_mm_cache": "vLLM's multimodal input cache; minivllm takes text only (llm.reset_prefix_cache() empties "
                      "the prefix cache)",
}


def refuse_mm_processor_kwargs(mm_processor_kwargs) -> None:
    """vLLM's ``mm_processor_kwargs`` argument: None passes (a vLLM script's default).

    Raises:
        ValueError: anything else, naming it (minivllm takes no multimodal inputs)."""
    if mm_processor_kwargs is not None:
        raise VLLMValidationError(f"mm_processor_kwargs={mm_processor_kwargs!r}: minivllm takes no multimodal inputs "
                                  "(README, 'Coming from vLLM or nano-vllm')")


class LLM:
    """Generate text with minivllm.

    Args:
        model: None (the embedded ``minivllm-tiny``, or ``$MINIVLLM_MODEL``),
            ``"minivllm-tiny"``, a local Hugging Face checkpoint directory, or
            ``"random:<preset>"`` (random weights at a real model's shape, e.g.
            ``"random:qwen3-0.6b"``, with the embedded tokenizer).
        **engine_args: any ``EngineArgs`` field (``max_num_seqs``, ``block_size``,
            ``enable_prefix_caching``, ``device``, ...). vLLM arguments that mean nothing
            here (``trust_remote_code``, ``swap_space``, ...: ``config.IGNORED_VLLM_ARGS``)
            are accepted with one logged warning listing them. ``chat_template``: as in vLLM, the
            template :meth:`chat` uses when its call gives none (a Jinja string or a file's path;
            :func:`minivllm.chat.load_chat_template`).

    Raises:
        TypeError: an engine argument that is neither ours nor a known vLLM one, or a vLLM one
            asking for a feature minivllm lacks (naming it).
        ValueError: an engine argument's bad value (naming it: a dtype, a block size, a
            max_model_len above what the KV pool holds, ...), or a ``chat_template`` path that
            cannot be read.
        FileNotFoundError: a model path that does not exist or holds no checkpoint.

    Use as a context manager, or call ``shutdown()``, to free the KV cache at once.

    Threads and notebooks: one ``LLM`` may be used from several threads at once (a widget
    running in the background while a cell calls ``generate``). Each engine step is atomic
    and every call receives exactly its own requests' outputs, whichever call ran the step,
    so concurrent ``generate`` / ``stream`` calls interleave step by step and all complete
    with the results they would have had alone (greedy or seeded). Interrupting a call
    (KeyboardInterrupt) rolls back the step in flight and aborts that call's requests only.
    """

    def __init__(self, model: str | None = None, **engine_args):
        #: the template :meth:`chat` renders with when given none (vLLM's ``LLM(chat_template=...)``)
        self.chat_template = load_chat_template(engine_args.pop("chat_template", None))
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model, engine_args))
        self._ids = itertools.count()
        # enqueue's requests until wait_for_completion returns them: their ids in order, their samples (n), the
        # inbox their final outputs are delivered to, and the outputs a wait took from it for requests enqueued
        # after it began (kept for the next wait); the lists and dicts under _enqueued_lock, one wait at a time
        self._enqueued: list[str] = []
        self._enqueued_samples: dict[str, int] = {}
        self._enqueued_inbox: deque[RequestOutput] = deque()
        self._enqueued_done: dict[str, RequestOutput] = {}
        self._enqueued_lock = threading.Lock()
        self._wait_lock = threading.Lock()
        self._unused_template_variables_told: set[tuple] = set()  # LLM.chat warns once per template and names
        self._overridden_template_variables_told: set[str] = set()  # ... and once per overridden names and values

    def __getattr__(self, name: str):
        # only for names the object lacks: nano-vllm's LLM is its engine, so its scripts call these here
        hint = _NANO_ENGINE_CALLS.get(name)
        if hint is not None:
            raise AttributeError(f"LLM.{name}: nano-vllm's LLM is its engine; here, as in vLLM, the engine is "
                                 f"llm.llm_engine: {hint}", name="")  # (no "Did you mean" guess at a private name)
        hint = _VLLM_LACKING_CALLS.get(name)
        if hint is not None:
            raise AttributeError(f"LLM.{name}: {hint} (README, 'Coming from vLLM or nano-vllm')", name="")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        """vLLM's ``LLM.from_engine_args``: an LLM with every field of ``engine_args``.

        Raises:
            TypeError: ``engine_args`` is not an :class:`EngineArgs`; else as ``LLM(...)``."""
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"engine_args must be an EngineArgs, got {type(engine_args).__name__}")
        return cls(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)})

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's ``LLM.get_world_size``: processes the model runs on, ``tensor_parallel_size``
        (there is no pipeline or data parallelism here, so ``include_dp`` changes nothing)."""
        return self.engine.config.args.tensor_parallel_size

    def get_model_inspection(self) -> str:
        """vLLM's ``LLM.get_model_inspection``: the model's module tree as ``torch.nn.Module``
        prints it (rank 0's shard under tensor parallelism)."""
        return str(self.engine.runner.model)

    # -- helpers --------------------------------------------------------------------------
    @property
    def engine(self) -> LLMEngine:
        """The live engine (``llm_engine``), checked.

        Raises:
            RuntimeError: the LLM has been shut down (``shutdown()``)."""
        if self.llm_engine.is_shut_down:
            raise RuntimeError("this LLM has been shut down (LLM.shutdown()): make a new LLM")
        return self.llm_engine

    @property
    def model_config(self):
        """vLLM's ``LLM.model_config`` (:class:`minivllm.config.ModelConfig`: ``max_model_len``,
        ``dtype``, ``hf_config``, ...)."""
        return self.engine.model_config

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (also ``llm.tokenizer``)."""
        return self.engine.tokenizer

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer (vLLM's ``LLM.tokenizer``)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling settings the checkpoint recommends (its ``generation_config.json``:
        temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), over
        ``SamplingParams()``'s defaults; what ``generate`` / ``stream`` / ``chat`` use when
        given no ``sampling_params`` (as vLLM does). Returns a new object each call.

        A ``generation_config.json`` that does not parse, or holds a value ``SamplingParams``
        refuses, already failed the ``LLM(...)`` call (naming the file and the value)."""
        return dataclasses.replace(self.engine.default_sampling_params)

    def _submit(self, ids: list[str], prompts, sampling_params, output_kind: str, inbox: deque, lora_request=None,
                priority=None, tokenization_kwargs: dict | None = None) -> None:
        """Validate every prompt, then queue them all, their outputs routed to ``inbox``; their
        request ids go into ``ids`` in order, each before its request is queued, so that a caller's
        clean-up (an interrupt anywhere after this call began) aborts whatever was queued."""
        refuse_lora(lora_request)
        tokenization = check_tokenization_kwargs(tokenization_kwargs)
        plist = _as_prompt_list(prompts)
        given = priority
        if isinstance(priority, numbers.Integral) and not isinstance(priority, bool):
            priority = [priority] * len(plist)  # vLLM's: one number for every prompt
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(plist)
                                     or any(p != 0 for p in priority)):
            raise VLLMValidationError(f"priority={given!r}: minivllm schedules first come, first served (only None, 0 or "
                                      f"a list of {len(plist)} zeros, one per prompt, is accepted)")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(plist):
                raise VLLMValidationError(f"got {len(sampling_params)} sampling_params for {len(plist)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params if sampling_params is not None else self.get_default_sampling_params()
                      ] * len(plist)
        for i, (prompt, p) in enumerate(zip(plist, params)):
            if not isinstance(p, SamplingParams):
                raise VLLMValidationError(f"sampling_params[{i}]={p!r} is not a SamplingParams")
            try:
                self.engine.check_sampling_params(p)  # all checked before any is queued
                p.clone()._validate_again()  # as add_request will: a list changed in place since the constructor
                _, prompt_ids = self.engine.encode_prompt(prompt, prompt_truncation(tokenization, p),
                                                          tokenization.get("add_special_tokens", True))
                self.engine.check_min_tokens_room(p, len(prompt_ids))
                cache_salt_of(prompt)
            except ValueError as e:
                raise VLLMValidationError(f"prompt {i}: {e}", parameter=getattr(e, "parameter", None),
                                          value=getattr(e, "value", None)) from None
        engine = self.engine
        for prompt, p in zip(plist, params):
            rid = str(next(self._ids))
            while rid in engine.requests or rid in engine.parents.parents:  # queued by hand (engine.add_request)
                rid = str(next(self._ids))
            ids.append(rid)  # before it is queued, so that an interrupt inside add_request is cleaned up too
            try:
                engine.add_request(rid, prompt, p, tokenization_kwargs=tokenization, output_kind=output_kind,
                                   sink=inbox.append)
            except ValueError:  # refused, so not queued: the id may be someone else's, and must not be aborted
                ids.pop()
                raise

    def _outputs(self, ids: list[str], inbox: deque, *, consumer_between: bool = False) -> Iterator[RequestOutput]:
        """This call's outputs as they arrive: step the engine while the inbox is empty.
        Steps run by another thread deliver to this inbox too.

        The steps run with the heap frozen (``heap_frozen``). ``generate`` (``consumer_between=False``)
        holds one freeze for the whole call, across its own yields: a freeze per step would reset the
        collector's count of new objects at every step. A stream (``consumer_between=True``) gives
        control to its consumer between yields, so its freeze ends before each yield: one held across
        them froze the consumer's objects too, the stream among them, and a stream dropped in a
        reference cycle was then never collected, its requests never aborted and the freeze never
        undone; a young-generation collection at each yield (when the collector is on) makes up for
        the count each freeze resets."""
        pending = set(ids)
        freeze = not caller_froze_heap()  # asked once per call: the answer walks the frozen objects
        try:
            if not consumer_between:
                with heap_frozen(freeze):
                    while pending:
                        yield self._next_output(pending, inbox)
                return
            while pending:
                with heap_frozen(freeze):
                    out = self._next_output(pending, inbox)
                if gc.isenabled():
                    gc.collect(0)
                yield out
        finally:
            self._abort(pending)  # on an exception (e.g. KeyboardInterrupt) or an early close

    def _next_output(self, pending: set, inbox: deque) -> RequestOutput:
        """The next of this call's outputs, stepping the engine until one is there."""
        while not inbox:
            if not self._step():  # an empty step: are this call's outputs still to come?
                self._require_deliverable(pending, inbox)
        out = inbox.popleft()
        if out.finished:
            pending.discard(out.request_id)
        return out

    def _require_deliverable(self, pending: set, inbox: deque) -> None:
        """After a step that scheduled nothing: raise if none of ``pending`` can still deliver an
        output, for each step would then schedule nothing and the caller would loop forever. That happens when a step's delivery was lost to
        an interrupt after the step committed (``LLMEngine.step``'s documented window), for a
        request another caller stepped to its end.

        Raises:
            RuntimeError: naming the requests whose outputs were lost."""
        engine = self.engine
        with engine._lock:  # a step in another thread delivers before it lets go of the lock
            engine._delivery.deliver_pending()  # what an interrupt after a commit left (engine/delivery.py)
            if inbox:
                return
            requests, parents = engine.requests, engine.parents.parents
            if any(rid in requests or rid in parents for rid in pending):
                return
        raise RuntimeError(f"request(s) {sorted(pending)} finished but their outputs never arrived (a step "
                           f"interrupted while it handed them over, after it had committed); the engine itself is "
                           f"consistent: submit them again")

    def _step(self) -> bool:
        """One engine step; returns whether it scheduled anything. A step that schedules nothing
        while requests wait would repeat forever, so it is an error (the engine's sizing checks
        should make it impossible)."""
        engine = self.engine
        # the step and the check under one hold of the lock: a request another thread queued after an idle
        # step is no missed progress (it was read as one between the two)
        with engine._lock:
            result = engine.step_with_record()
            if result.record.num_seqs == 0:
                if engine.has_unfinished_requests():
                    raise RuntimeError("the scheduler made no progress with requests waiting "
                                       f"({engine.get_num_unfinished_requests()} unfinished); this is a bug")
                return False
        return True

    def _samples(self, request_ids) -> int:
        """How many samples ``request_ids`` ask for: ``SamplingParams.n`` each (a parent request of
        the engine's, ``minivllm/engine/parallel_sampling.py``), else 1."""
        parents = self.engine.parents.parents
        return sum(parents[rid].n if rid in parents else 1 for rid in request_ids)

    def _abort(self, request_ids) -> None:
        if not self.llm_engine.is_shut_down:
            for rid in request_ids:
                self.llm_engine.abort_request(rid)

    # -- public API ------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True, lora_request=None,
                 priority: int | list[int] | None = None, tokenization_kwargs: dict | None = None,
                 mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Run prompts to completion; returns one ``RequestOutput`` per prompt, in prompt order.

        ``prompts``: one prompt or a list (a ``str``, a ``list[int]``, a ``TextPrompt`` or a
        ``TokensPrompt``). ``sampling_params``: one for all, one per prompt, or None for
        ``get_default_sampling_params()``. ``use_tqdm``: a progress bar (``tqdm.auto``), or a
        callable that makes one, called as ``tqdm`` is (vLLM's). ``lora_request`` and
        ``priority``: vLLM's; only None (or, for ``priority``, 0 or a list of zeros: first come, first
        served) is accepted. ``tokenization_kwargs``: vLLM's ``truncate_prompt_tokens`` and
        ``add_special_tokens`` (:func:`minivllm.inputs.check_tokenization_kwargs`).
        ``mm_processor_kwargs``: vLLM's; None only (no multimodal inputs here).

        Raises:
            ValueError: a bad prompt or parameter (naming its index and value), a
                ``lora_request``, a nonzero ``priority``, bad ``tokenization_kwargs`` or
                ``mm_processor_kwargs``, before anything is scheduled.
            TypeError: a ``use_tqdm`` callable that does not take tqdm's arguments.
            RuntimeError: the LLM has been shut down, or a tensor-parallel worker died; or (both
                naming the requests) a request's outputs were lost to an interrupt after its step
                committed while another call stepped it to its end, or the scheduler made no
                progress with requests waiting (a bug).
        """
        inbox: deque[RequestOutput] = deque()
        ids: list[str] = []
        # One try from the first request queued to the last output: an exception anywhere (a bad
        # use_tqdm callable, a KeyboardInterrupt between any two lines) aborts this call's requests,
        # and only them; those already finished are not aborted again (abort_request ignores them).
        try:
            refuse_mm_processor_kwargs(mm_processor_kwargs)
            self._submit(ids, prompts, sampling_params, "final_only", inbox, lora_request, priority,
                         tokenization_kwargs)
            results = self._run_to_end(ids, inbox, use_tqdm)
        except BaseException:
            self._abort(ids)
            raise
        return [results[i] for i in ids]

    def _run_to_end(self, ids: list[str], inbox: deque, use_tqdm,
                    samples: int | None = None) -> dict[str, RequestOutput]:
        """Step until every request of ``ids`` has its final output (from ``inbox``); returns those
        and any other output taken from ``inbox``, by request id. ``use_tqdm``: a progress bar
        (``tqdm.auto``) or a callable that makes one, of ``samples`` ticks (default: counted from
        the engine's requests when the bar is made), one per sample of ``ids`` as vLLM's (n of them
        for a prompt with ``SamplingParams.n = n``)."""
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = None
        try:
            if use_tqdm:
                if callable(use_tqdm):
                    make_bar = use_tqdm
                else:
                    from tqdm.auto import tqdm as make_bar
                total = self._samples(ids) if samples is None else samples
                bar = make_bar(total=total, desc="Processed prompts", dynamic_ncols=True)
            for out in self._outputs(list(ids), inbox):
                results[out.request_id] = out
                if bar is not None and out.request_id in wanted:
                    bar.update(len(out.outputs))
        finally:
            if bar is not None:
                bar.close()
        return results

    def stream(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
               lora_request=None, tokenization_kwargs: dict | None = None) -> Iterator[RequestOutput]:
        """Yield a delta ``RequestOutput`` for each request at every engine step that gave it new
        tokens (vLLM's DELTA kind): one token, or several in a step of speculative decoding;
        ``outputs[0].text`` / ``.token_ids`` hold only what is new; ``finished`` is True on a
        request's last item. Closing the iterator early aborts the unfinished requests.
        ``prompts``, ``sampling_params``, ``lora_request`` and ``tokenization_kwargs`` are
        :meth:`generate`'s.

        Raises:
            ValueError: as :meth:`generate` for bad prompts or parameters; a generator checks them
                when first advanced (``next``), not when called.
            RuntimeError: as :meth:`generate` (shut down, a worker died, lost outputs).
        """
        inbox: deque[RequestOutput] = deque()
        ids: list[str] = []
        try:  # as generate: an interrupt or a close anywhere aborts what this call queued
            self._submit(ids, prompts, sampling_params, "delta", inbox, lora_request,
                         tokenization_kwargs=tokenization_kwargs)
            yield from self._outputs(ids, inbox, consumer_between=True)
        except BaseException:  # GeneratorExit (close, or the stream dropped) included
            self._abort(ids)
            raise

    def enqueue(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                lora_request=None, priority: int | list[int] | None = None,
                use_tqdm: bool | Callable[..., Any] = True, tokenization_kwargs: dict | None = None,
                mm_processor_kwargs: dict | None = None) -> list[str]:
        """Queue prompts without running them (vLLM's ``LLM.enqueue``); returns their request ids.
        :meth:`wait_for_completion` then runs the engine until they are finished. Arguments as
        :meth:`generate`'s (``use_tqdm`` is accepted; nothing here takes long enough to show one).

        Raises:
            ValueError: as :meth:`generate`, before any of this call's prompts is queued.
            RuntimeError: the LLM has been shut down.
        """
        mine: list[str] = []
        try:  # an interrupt anywhere aborts this call's requests (and only them): none stays queued unlisted
            refuse_mm_processor_kwargs(mm_processor_kwargs)
            self._submit(mine, prompts, sampling_params, "final_only", self._enqueued_inbox, lora_request, priority,
                         tokenization_kwargs)
            samples = {rid: self._samples([rid]) for rid in mine}
            with self._enqueued_lock:
                self._enqueued_samples.update(samples)
                self._enqueued.extend(mine)
        except BaseException:
            self._abort(mine)
            self._forget_enqueued(mine)
            raise
        return list(mine)

    def _forget_enqueued(self, ids) -> None:
        """Take ``ids`` off the enqueued requests (with any output kept for them)."""
        drop = set(ids)
        with self._enqueued_lock:
            self._enqueued[:] = [rid for rid in self._enqueued if rid not in drop]
            for rid in drop:
                self._enqueued_samples.pop(rid, None)
                self._enqueued_done.pop(rid, None)

    def enqueue_chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                     use_tqdm: bool | Callable[..., Any] = True, lora_request=None,
                     priority: int | list[int] | None = None, chat_template: str | None = None,
                     chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
                     continue_final_message: bool = False, tools: list[dict] | None = None,
                     chat_template_kwargs: dict | None = None, tokenization_kwargs: dict | None = None,
                     mm_processor_kwargs: dict | None = None) -> list[str]:
        """:meth:`chat`'s conversations, rendered the same way, queued as :meth:`enqueue` queues
        prompts (vLLM's ``LLM.enqueue_chat``); returns their request ids.

        Raises:
            ValueError: as :meth:`chat`, before anything is queued.
            RuntimeError: the LLM has been shut down.
        """
        prompts, tokenization_kwargs = self._chat_prompts(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, chat_template_kwargs=chat_template_kwargs,
            chat_template_content_format=chat_template_content_format, mm_processor_kwargs=mm_processor_kwargs,
            tokenization_kwargs=tokenization_kwargs)
        return self.enqueue(prompts, sampling_params, lora_request=lora_request, priority=priority,
                            tokenization_kwargs=tokenization_kwargs)

    def wait_for_completion(self, output_type=None, *, use_tqdm: bool | Callable[..., Any] = True
                            ) -> list[RequestOutput]:
        """Run the engine until every request :meth:`enqueue` / :meth:`enqueue_chat` queued is
        finished; returns their final ``RequestOutput``s in the order they were queued, and forgets
        them (vLLM's ``LLM.wait_for_completion``; vLLM returns every unfinished request of the
        engine, here requests queued by other means, such as ``llm.llm_engine.add_request``, are
        left to their caller). ``output_type``: vLLM's; ``RequestOutput`` (or None), the only
        kind of output here. ``use_tqdm``: as :meth:`generate`'s. Interrupted (KeyboardInterrupt),
        it aborts the requests it waits for that have not finished, as ``generate`` aborts its own.

        Threads: several may enqueue at once; waits run one at a time, each for the requests
        enqueued when it began (an output it receives for one enqueued later is kept for the next
        wait).

        Raises:
            TypeError: an ``output_type`` other than ``RequestOutput`` (a pooling output).
            RuntimeError: as :meth:`generate`.
        """
        kinds = output_type if isinstance(output_type, tuple) else (output_type,)
        if output_type is not None and RequestOutput not in kinds:
            raise TypeError(f"output_type={output_type!r}: minivllm gives RequestOutput only (no pooling models)")
        with self._wait_lock:  # one wait at a time: each runs what was enqueued when it began
            with self._enqueued_lock:
                ids = list(self._enqueued)
                done = self._enqueued_done
                pending = [rid for rid in ids if rid not in done]  # (outputs an earlier wait took for them)
                samples = sum(self._enqueued_samples.get(rid, 1) for rid in pending)
            try:
                results = self._run_to_end(pending, self._enqueued_inbox, use_tqdm if pending else False, samples)
                with self._enqueued_lock:
                    # outputs of requests enqueued after this wait began are kept for the next one; an aborted
                    # request's (no longer enqueued) are dropped
                    live = set(self._enqueued)
                    done.update({rid: out for rid, out in results.items() if rid in live})
                    outs = [done[rid] for rid in ids]
                self._forget_enqueued(ids)
            except BaseException:
                self._abort(ids)
                self._forget_enqueued(ids)
                raise
        return outs

    def beam_search(self, prompts, params=None, *args, **kwargs):
        """vLLM's ``LLM.beam_search``: not implemented here.

        Raises:
            NotImplementedError: always (greedy decoding, ``n`` > 1 with sampling, and
                ``logprobs=0`` for each completion's ``cumulative_logprob`` are the nearest alternatives).
        """
        raise NotImplementedError(f"LLM.beam_search: {NO_BEAM_SEARCH}")

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None, priority: int | list[int] | None = None,
             chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             chat_template_content_format: str = "auto", mm_processor_kwargs: dict | None = None,
             tokenization_kwargs: dict | None = None, **unknown) -> list[RequestOutput]:
        """Render one conversation (a list of ``{"role", "content"}`` dicts) or a list of them
        with a chat template, then ``generate`` (vLLM's ``LLM.chat``). ``content`` may be a
        string, None, or OpenAI-style text parts (joined by newlines, as vLLM renders them for
        string templates: :func:`minivllm.chat.text_messages`).

        Args:
            messages: one conversation, or a list (or tuple) of them.
            sampling_params / use_tqdm / lora_request / priority: as :meth:`generate`'s (one
                ``SamplingParams`` per conversation, or one for all; the arguments in vLLM's order).
            chat_template: a Jinja template used instead of the tokenizer's.
            add_generation_prompt: end the prompt with the assistant turn's opening.
            continue_final_message: leave the last (assistant) message open so the model
                continues it; exclusive with ``add_generation_prompt``.
            tools: tool (function) schemas, passed to the template as ``tools``.
            chat_template_kwargs: extra template variables (e.g. Qwen3's
                ``{"enable_thinking": False}``); as in vLLM 0.34, the arguments
                ``add_generation_prompt``, ``continue_final_message`` and ``tools`` win over the same
                names given here (``tools`` only when not None; a value overridden is warned of).
            chat_template_content_format: vLLM's; "auto" or "string" (text parts are joined into
                one string, the format this renders; "openai" is refused).
            mm_processor_kwargs: vLLM's; None only (no multimodal inputs here).
            tokenization_kwargs: as ``generate``'s. The rendered text is tokenized without adding
                special tokens (``add_special_tokens=False``, vLLM's: the template writes any BOS
                itself) unless these say otherwise.

        Raises:
            TypeError: a keyword argument ``LLM.chat`` does not take (a template variable goes in
                ``chat_template_kwargs``), as vLLM's fixed signature refuses it.
            ValueError: no chat template (neither given nor the tokenizer's), both
                ``add_generation_prompt`` and ``continue_final_message``, either of them not a bool,
                ``messages`` not a list or tuple (a lone message dict included), ``chat_template`` not a
                string, ``chat_template_kwargs`` not a dict, ``tools`` not a list of dicts or functions, an empty
                conversation, a malformed message or a non-text content part (naming it), a content format other than "auto" or
                "string", ``chat_template_kwargs`` naming ``chat_template`` or ``tokenize`` (as vLLM),
                ``mm_processor_kwargs``, or a bad prompt.
            RuntimeError: as :meth:`generate` (the LLM shut down, a worker died, lost outputs).
        """
        if unknown:
            import difflib
            import inspect

            taken = [n for n in inspect.signature(LLM.chat).parameters if n not in ("self", "unknown")]
            near = {n: difflib.get_close_matches(n, taken, n=1) for n in sorted(unknown)}
            hint = "; ".join(f"{n!r}: did you mean {m[0]!r}?" for n, m in near.items() if m)
            raise TypeError(f"LLM.chat() got unexpected keyword argument(s) {sorted(unknown)}"
                            + (f" ({hint})" if hint else "")
                            + ": template variables go in chat_template_kwargs={...}, as in vLLM")
        prompts, tokenization_kwargs = self._chat_prompts(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, chat_template_kwargs=chat_template_kwargs,
            chat_template_content_format=chat_template_content_format, mm_processor_kwargs=mm_processor_kwargs,
            tokenization_kwargs=tokenization_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                             priority=priority, tokenization_kwargs=tokenization_kwargs)

    def _chat_prompts(self, messages, *, chat_template=None, add_generation_prompt=True, continue_final_message=False,
                      tools=None, chat_template_kwargs=None, chat_template_content_format="auto",
                      mm_processor_kwargs=None, tokenization_kwargs=None) -> tuple[list[str], dict]:
        """:meth:`chat`'s rendering: ``(prompt texts, tokenization_kwargs)`` for ``generate`` or
        ``stream`` (the command line's ``chat`` streams them). Raises as :meth:`chat` (ValueError)."""
        if chat_template_content_format not in ("auto", "string"):
            raise VLLMValidationError(f"chat_template_content_format={chat_template_content_format!r}: minivllm renders "
                                      "text parts joined into one string: use 'auto' or 'string'")
        refuse_mm_processor_kwargs(mm_processor_kwargs)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise VLLMValidationError(f"chat_template_kwargs={chat_template_kwargs!r}: must be a dict of template variables")
        if chat_template is not None and not isinstance(chat_template, str):
            raise VLLMValidationError(f"chat_template={chat_template!r}: must be a Jinja template string")
        if chat_template is None:
            chat_template = self.chat_template  # LLM(chat_template=...), else the tokenizer's (None)
        # vLLM 0.34's order (renderers/params.py merge_kwargs): the arguments win over the dict; tools only when
        # not None. The two flags must be bools ("no" would open the assistant turn), so theirs always win.
        variables = dict(chat_template_kwargs or {})
        for where, value in (("add_generation_prompt", add_generation_prompt),
                             ("continue_final_message", continue_final_message),
                             ("chat_template_kwargs['add_generation_prompt']", variables.get("add_generation_prompt", True)),
                             ("chat_template_kwargs['continue_final_message']", variables.get("continue_final_message", False))):
            if not isinstance(value, bool):
                raise VLLMValidationError(f"{where}={value!r}: must be True or False")
        arguments = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        if tools is not None:
            arguments["tools"] = tools
        overridden = sorted((k, variables[k]) for k, v in arguments.items() if k in variables and variables[k] != v)
        if overridden and repr(overridden) not in self._overridden_template_variables_told:  # once per names, values
            self._overridden_template_variables_told.add(repr(overridden))
            logger.warning("LLM.chat: chat_template_kwargs' %s overridden by the argument(s) of the same name, as "
                           "vLLM does (give them as LLM.chat's own arguments)",
                           ", ".join(f"{k}={v!r}" for k, v in overridden))
        variables.update(arguments)
        variables.setdefault("tools", None)
        why = {"chat_template": "give it as LLM.chat's own argument",
               "tokenize": "the text is always rendered, then tokenized by generate: leave it out",
               "messages": "the conversation is LLM.chat's first argument"}
        misplaced = sorted(why.keys() & variables.keys())
        if misplaced:
            raise VLLMValidationError(f"chat_template_kwargs names {misplaced}: "
                                      + "; ".join(f"{name}: {why[name]}" for name in misplaced))
        add_generation_prompt = variables["add_generation_prompt"]
        continue_final_message = variables["continue_final_message"]
        tools = variables["tools"]
        if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, (list, tuple))
                                  or not all(isinstance(t, Mapping) or callable(t) for t in tools)):
            where = "tools" if "tools" in arguments else "chat_template_kwargs['tools']"
            raise VLLMValidationError(f"{where}={tools!r}: must be a list of tools: (function) schemas, dicts such as "
                                      "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}, or Python "
                                      "functions (transformers builds their schemas from signature and docstring)")
        tok = self.get_tokenizer()
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise VLLMValidationError(f"model {self.engine.source.name!r}: its tokenizer has no chat template "
                                      "(pass chat_template=...)")
        if add_generation_prompt and continue_final_message:
            raise VLLMValidationError("add_generation_prompt=True and continue_final_message=True: choose one "
                                      "(set add_generation_prompt=False to continue the final message)")
        if isinstance(messages, Mapping):  # iterated, a lone message would give its keys as conversations
            raise VLLMValidationError(f"messages={messages!r}: one message on its own; pass a list of messages (a "
                                      "conversation) or a list of conversations")
        if not isinstance(messages, (list, tuple)):
            raise VLLMValidationError(f"messages={messages!r}: must be a list of messages (a conversation) or a list of "
                                      "conversations")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        self._warn_unused_template_variables(chat_template if chat_template is not None else tok.chat_template,
                                             variables)
        prompts = [tok.apply_chat_template(text_messages(conv, i), tokenize=False, chat_template=chat_template,
                                           **variables)
                   for i, conv in enumerate(conversations)]
        # the template wrote the special tokens it wants; a tokenizer that adds a BOS would add a second
        tokenization_kwargs = {"add_special_tokens": False, **check_tokenization_kwargs(tokenization_kwargs)}
        return prompts, tokenization_kwargs

    def _warn_unused_template_variables(self, template, variables: dict) -> None:
        """A warning (once per template and names) for ``tools`` or a ``chat_template_kwargs`` variable
        the chat template never reads: the prompt is the one it would be without them."""
        if not isinstance(template, str):  # a dict of named templates: not judged
            return
        passed = [name for name, value in variables.items()
                  if value is not None and name not in ("add_generation_prompt", "continue_final_message")]
        unused = tuple(unused_template_variables(template, passed)) if passed else ()
        if unused and (hash(template), unused) not in self._unused_template_variables_told:
            self._unused_template_variables_told.add((hash(template), unused))
            which = (f"{self.llm_engine.source.name}'s chat template" if template is self.get_tokenizer().chat_template
                     else "the chat_template given")
            logger.warning("LLM.chat: %s never reads %s: the prompt is what it would be without %s", which,
                           ", ".join(unused), "it" if len(unused) == 1 else "them")

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's ``LLM.start_profile``: a ``torch.profiler`` trace of this process until
        :meth:`stop_profile`, written where ``profiler_config`` or ``$VLLM_TORCH_PROFILER_DIR``
        says (see ``LLMEngine.start_profile``, which names what it raises)."""
        self.engine.start_profile(profile_prefix)

    def stop_profile(self):
        """Stop the trace and write it; returns its path (``LLMEngine.stop_profile``)."""
        return self.engine.stop_profile()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every prefix-cache entry (vLLM's ``LLM.reset_prefix_cache``); returns True. The
        flags are vLLM's: ``reset_running_requests=True`` first preempts the running requests (they
        recompute); see ``LLMEngine.reset_prefix_cache``."""
        return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def shutdown(self) -> None:
        """Free the engine's model and KV cache. Safe to call twice. ``llm.llm_engine`` stays (as
        in vLLM), so a later ``llm.llm_engine.step()`` raises the engine's ``RuntimeError``."""
        engine = getattr(self, "llm_engine", None)  # None when __init__ failed before making it
        if engine is not None and not engine.is_shut_down:
            engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
