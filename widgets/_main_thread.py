"""Widget callbacks run on the kernel's main thread, where Kernel > Interrupt reaches them.

JupyterLab 4.6 with ipykernel 7 sends widget messages to a kernel subshell (Settings >
Kernel > "Kernel Comms over subshells", default one subshell per comm target), and ipykernel
routes a comm's messages to the thread that last published on it. A callback that updates its
own widget (a button disabled while it works) therefore runs every later click on the
subshell's thread. There, Kernel > Interrupt cannot stop it (Python runs signal handlers on the
main thread only), and it runs beside the cell the main thread is executing.

:func:`on_main_thread` hands such a call to the main thread's event loop and waits for it, the
way ipykernel 6 ran every callback: after a cell in progress (an async cell lets it run at its
``await``), with SIGINT raising ``KeyboardInterrupt`` inside it. As under ipykernel 6, the
widget messages behind a click wait until its callback is done.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import signal
import threading
from typing import Callable


def _main_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on the main thread now (a notebook cell's), else None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # a script or a test: no kernel loop
        return None


def _on_kernel_subshell() -> bool:
    """Whether this thread is one of ipykernel's subshells (ipykernel >= 7) and the main thread
    runs the kernel's asyncio loop rather than a GUI toolkit's (``%gui qt``: that loop wakes
    only for the main shell's messages). Other threads, a user's worker clicking a button
    included, call directly: handing their calls over could wait on the cell that waits for
    them."""
    try:
        from ipykernel.kernelbase import Kernel
        from ipykernel.subshell import SubshellThread
    except ImportError:  # ipykernel 6 has no subshells; no ipykernel at all: a script
        return False
    if not isinstance(threading.current_thread(), SubshellThread):
        return False
    return not (Kernel.initialized() and Kernel.instance().eventloop is not None)


def _call_interruptibly(fn: Callable, args, kwargs, done: concurrent.futures.Future) -> None:
    """Run ``fn`` on the main thread with SIGINT raising ``KeyboardInterrupt`` in it.

    ``default_int_handler`` would raise anywhere in the loop (a ``KeyboardInterrupt`` escaping
    an asyncio callback stops the kernel's loop), so the handler raises only while ``fn`` runs;
    a SIGINT landing just before or after it is raised again once the previous handler is back
    (an idle kernel's ignores it). A ``KeyboardInterrupt`` ends the call quietly: the widgets
    catch it to say what was interrupted, then re-raise it as a cell would."""
    inside, missed = False, False

    def on_sigint(signum, frame):
        nonlocal missed
        if inside:
            raise KeyboardInterrupt
        missed = True

    saved = signal.signal(signal.SIGINT, on_sigint)
    try:
        try:
            inside = True
            result = fn(*args, **kwargs)
        finally:
            inside = False
        done.set_result(result)
    except KeyboardInterrupt:
        done.set_result(None)
    except BaseException as e:  # raised on the calling thread, where the kernel logs it
        done.set_exception(e)
    finally:
        if signal.getsignal(signal.SIGINT) is on_sigint:  # unless fn installed its own and kept it
            signal.signal(signal.SIGINT, saved)
            if missed:
                asyncio.get_running_loop().call_soon(signal.raise_signal, signal.SIGINT)


def on_main_thread(fn: Callable) -> Callable:
    """Wrap a widget callback so that a call from a kernel subshell runs on the main thread.

    Call it where the widget is built (a notebook cell, on the main thread): that cell's event
    loop is the one calls are handed to. A call arriving on one of ipykernel's subshell threads
    is scheduled there and waited for; its result is returned and its exception raised on the
    calling thread, except ``KeyboardInterrupt``, which ends the call (the callback has said
    so). Any other call (the main thread, a thread of the user's, ipykernel 6, a stopped loop)
    calls ``fn`` directly, as does a wrapper built where no event loop runs (a script, a test).

    Args:
        fn: the callback (a button's ``on_click`` handler, a trait observer).

    Returns:
        the wrapped callable, or ``fn`` itself where no main-thread loop runs.
    """
    loop = _main_loop()
    if loop is None:
        return fn

    @functools.wraps(fn)
    def callback(*args, **kwargs):
        if not (loop.is_running() and _on_kernel_subshell()):
            return fn(*args, **kwargs)
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            loop.call_soon_threadsafe(_call_interruptibly, fn, args, kwargs, done)
        except RuntimeError:  # the loop closed in between (the kernel is shutting down)
            return fn(*args, **kwargs)
        return done.result()

    return callback
