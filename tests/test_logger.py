"""The ``minivllm`` logger behaves as vLLM's: INFO on stderr by default, ``MINIVLLM_LOGGING_LEVEL``
changes the level, and an application that configures logging gets each record once."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "MINIVLLM_LOGGING_LEVEL"}
    full.update(env, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=full)


def test_engine_startup_is_logged_at_info_by_default():
    res = _run("from minivllm import LLM; LLM()")
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "minivllm engine:" in ln]
    assert len(lines) == 1 and lines[0].startswith("INFO ") and "attention_backend=" in lines[0], res.stderr


def test_level_from_the_environment():
    code = ("import logging, minivllm; log = logging.getLogger('minivllm.test'); "
            "log.info('an info line'); log.warning('a warning line')")
    quiet = _run(code, MINIVLLM_LOGGING_LEVEL="WARNING")
    assert "an info line" not in quiet.stderr and "WARNING" in quiet.stderr and "a warning line" in quiet.stderr
    debug = _run(code.replace("log.info", "log.debug"), MINIVLLM_LOGGING_LEVEL="debug")
    assert "DEBUG" in debug.stderr and "an info line" in debug.stderr
    bad = _run(code, MINIVLLM_LOGGING_LEVEL="loud")
    assert "is not a logging level" in bad.stderr and "an info line" in bad.stderr


def test_a_level_the_application_set_before_the_import_is_kept():
    """`import minivllm` reset the application's own `getLogger("minivllm").setLevel(WARNING)` to INFO."""
    code = ("import logging; logging.getLogger('minivllm').setLevel(logging.WARNING); import minivllm; "
            "log = logging.getLogger('minivllm.test'); log.info('an info line'); log.warning('a warning line')")
    kept = _run(code)
    assert "an info line" not in kept.stderr and "a warning line" in kept.stderr, kept.stderr
    assert "an info line" in _run(code, MINIVLLM_LOGGING_LEVEL="INFO").stderr  # the variable, when set, wins


def test_an_application_handler_gets_each_record_once():
    code = ("import logging; logging.basicConfig(format='APP %(name)s %(message)s'); import minivllm; "
            "logging.getLogger('minivllm.test').info('hello')")
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("hello") == 1 and "APP minivllm.test hello" in res.stderr, res.stderr


def test_records_reach_pytest_log_capture(caplog):
    import minivllm  # noqa: F401  (configures the logger)

    with caplog.at_level(logging.INFO, logger="minivllm"):
        logging.getLogger("minivllm.test").info("captured")
    assert "captured" in caplog.text
