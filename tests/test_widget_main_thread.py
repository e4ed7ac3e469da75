"""Widget callbacks arriving on a kernel subshell's thread run on the main thread.

JupyterLab 4.6 with ipykernel 7 delivers a widget's clicks on a subshell thread once a callback
has updated its own widget; there Kernel > Interrupt (SIGINT, main thread only) could not stop
"measure this point" or "Run both", and the engine ran beside the cell on the main thread. Here a
worker thread stands in for the subshell while the main thread runs an event loop, as a kernel's
does between cells."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import threading
import time

import pytest

pytest.importorskip("ipywidgets")

from widgets._main_thread import on_main_thread  # noqa: E402


@pytest.fixture
def idle_kernel_sigint():
    """SIGINT ignored, as an idle ipykernel leaves it; the test's handler put back after."""
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, saved)


async def _on_subshell(fn, *args):
    """``fn(*args)`` on a real ipykernel subshell thread (its own tornado loop), awaited here."""
    zmq = pytest.importorskip("zmq")
    subshell = pytest.importorskip("ipykernel.subshell")
    context = zmq.Context()
    thread = subshell.SubshellThread("test-subshell", context)
    thread.start()
    done = concurrent.futures.Future()

    def call():
        try:
            done.set_result(fn(*args))
        except BaseException as e:
            done.set_exception(e)

    thread.io_loop.add_callback(call)
    try:
        return await asyncio.wrap_future(done)
    finally:
        thread.stop()
        thread.join()
        context.destroy(linger=0)


def _from_other_thread(build, *args):
    """Build a wrapper on the main thread's running loop, call it from a kernel subshell."""
    async def main():
        return await _on_subshell(build(), *args)

    return asyncio.run(main())


def test_a_call_from_another_thread_runs_on_the_main_thread_and_returns_its_result():
    threads = []

    def fn(x):
        threads.append(threading.current_thread())
        return 2 * x

    assert _from_other_thread(lambda: on_main_thread(fn), 21) == 42
    assert threads == [threading.main_thread()]


def test_an_exception_is_raised_on_the_calling_thread():
    def fn():
        raise ValueError("prompt_len=0: refused")

    with pytest.raises(ValueError, match="prompt_len=0"):
        _from_other_thread(lambda: on_main_thread(fn))


def test_a_call_from_a_thread_of_the_users_runs_there():
    # handing it to the main loop would deadlock a cell that clicks from a worker and joins it
    threads = []

    def fn():
        threads.append(threading.current_thread())

    async def main():
        wrapped = on_main_thread(fn)
        worker = threading.Thread(target=wrapped)
        worker.start()
        worker.join(5)  # the main loop is blocked here, as in a cell
        return worker

    worker = asyncio.run(main())
    assert not worker.is_alive() and threads == [worker]


def test_without_a_running_loop_the_callback_is_returned_as_is():
    def fn():
        return 1

    assert on_main_thread(fn) is fn


def test_a_kernel_interrupt_during_the_call_raises_in_it_and_nowhere_else(idle_kernel_sigint):
    seen = []

    def fn():
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs on the next bytecode: inside the try
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.001)
        except KeyboardInterrupt:
            seen.append("interrupted")
            raise  # as the widgets do, after saying so
        return "ran to the end"

    assert _from_other_thread(lambda: on_main_thread(fn)) is None
    assert seen == ["interrupted"]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the idle kernel's handler is back

    async def after():  # an interrupt between callbacks stays ignored, as in an idle kernel
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.01)
        return "loop alive"

    assert asyncio.run(after()) == "loop alive"


def test_a_stepper_step_clicked_from_a_subshell_thread_steps_on_the_main_thread(model_path):
    from minivllm import LLM
    from widgets import EngineStepper

    llm = LLM(model_path, block_size=16, num_kvcache_blocks=32, max_num_batched_tokens=64)
    try:
        engine = llm.llm_engine
        real_step, stepped_on = engine.step, []

        def step():
            stepped_on.append(threading.current_thread())
            return real_step()

        engine.step = step

        def build():
            s = EngineStepper(llm, show_chart=False)
            s.add_request([1, 2, 3, 4, 5], max_tokens=3)
            return s.step_button.click

        _from_other_thread(build)
        assert stepped_on == [threading.main_thread()]
    finally:
        llm.shutdown()


def test_a_latency_measurement_from_a_subshell_thread_is_interruptible(model_path, idle_kernel_sigint, monkeypatch):
    from minivllm import LLM
    from widgets import LatencyCalculator
    import widgets.latency_calculator as lc

    llm = LLM(model_path, block_size=16, num_kvcache_blocks=32, max_num_batched_tokens=64)
    try:
        def slow_measurement(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)  # Kernel > Interrupt, a moment into the measurement
            time.sleep(5)
            raise AssertionError("the interrupt did not reach the measurement")

        monkeypatch.setattr(lc, "measure_request_latency", slow_measurement)
        calc = []

        def build():
            calc.append(LatencyCalculator(llm, prompt_lens=(8, 16), batch_sizes=(1, 2)))
            return calc[0].measure_button.click

        _from_other_thread(build)
        assert "interrupted (Kernel &gt; Interrupt)" in calc[0].readout.value
        assert not calc[0].measure_button.disabled
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from test_widgets import _model_path

    return _model_path(tmp_path_factory)


def test_an_interrupt_just_after_the_call_reaches_the_handler_from_before():
    # a SIGINT between the callback's return and the handler's restore was dropped: a background
    # "Run to end" (whose handler was the one before) never heard of it
    from widgets._main_thread import _call_interruptibly

    heard = []

    async def main():
        done = concurrent.futures.Future()
        done.add_done_callback(lambda _f: os.kill(os.getpid(), signal.SIGINT))  # lands after fn returned
        _call_interruptibly(lambda: "result", (), {}, done)
        for _ in range(10):
            await asyncio.sleep(0.001)
        return done.result()

    saved = signal.signal(signal.SIGINT, lambda signum, frame: heard.append(signum))
    try:
        assert asyncio.run(main()) == "result"
    finally:
        signal.signal(signal.SIGINT, saved)
    assert heard == [signal.SIGINT]
