"""The new user's path stays coherent: README commands, .ci/run, pyproject and environment.yml agree."""
from __future__ import annotations

import re
from pathlib import Path

import yaml
from packaging.markers import Marker

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the dev extra brings tomli, the same parser
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _spec(req: str) -> str:
    return req.split(";")[0].split("#")[0].replace(" ", "")


def test_environment_yml_agrees_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in ("lab", "dev", "gpu"):
        wanted += project["optional-dependencies"][extra]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    have = {_name(r): _spec(r) for r in pip_section if not r.startswith("-")}
    env_text = (ROOT / "environment.yml").read_text()
    # flash-attn builds against the installed torch: a separate step in both, not an extra pip would isolate
    assert "pip install flash-attn --no-build-isolation" in env_text
    assert "pip install flash-attn --no-build-isolation" in (ROOT / "README.md").read_text()
    assert all(_name(r) != "flash-attn" for r in wanted)
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python="))
    for req in wanted:
        name = _name(req)
        marker = req.split(";")[1].split("#")[0].strip() if ";" in req else ""
        if "python_version" in marker and not Marker(marker).evaluate({"python_version": python.split("=")[1]}):
            continue  # a back-port for an older Python than environment.yml's
        assert name in have, f"{name} is in pyproject.toml but not in environment.yml"
        assert have[name] == _spec(req), f"{name}: environment.yml has {have[name]}, pyproject {_spec(req)}"


def _readme_command(label: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {label} -->\s*```(?:bash|sh)?\n(.+?)\n```", text, re.S)
    assert m, f"README has no block marked <!-- {label} -->"
    return m.group(1).strip()


def test_ci_runs_the_readme_test_command():
    assert _readme_command("test-command") in (ROOT / ".ci" / "run").read_text()


def test_readme_main_command_uses_the_cli():
    assert "python -m minivllm generate" in _readme_command("main-command")


def test_readme_documents_the_console_script_beside_python_m():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    text = (ROOT / "README.md").read_text()
    for name in scripts:
        assert f"`{name} generate" in text and f"`{name} bench" in text, f"README does not show the {name} command"
    assert "python -m minivllm generate" in text


def test_readme_download_command_is_the_one_huggingface_hub_ships():
    """huggingface-hub 1.x installs ``hf``; ``huggingface-cli`` is gone."""
    text = (ROOT / "README.md").read_text()
    assert "huggingface-cli" not in text and "hf download " in text


def test_readme_streaming_snippets_end_their_line():
    """A snippet that prints streamed deltas with ``end=""`` prints a newline after the loop, so the
    next output does not continue the streamed line."""
    blocks = re.findall(r"```python\n(.+?)\n```", (ROOT / "README.md").read_text(), re.S)
    streaming = [b for b in blocks if 'end=""' in b]
    assert streaming, "the README's streaming example is gone"
    for block in streaming:
        lines = block.splitlines()
        last = max(i for i, line in enumerate(lines) if 'end=""' in line)
        after = [line.split("#")[0].strip() for line in lines[last + 1:]]
        assert "print()" in after, f"no print() after the streamed output in:\n{block}"


def test_readme_and_docs_tables_keep_one_line_per_row():
    """A table row cut by a line break (the README's batch-32 row once was) renders its tail as a row of
    its own, the figures under the wrong column: every line of a table is a whole row."""
    for path in (ROOT / "README.md", ROOT / "docs" / "benchmarks.md"):
        in_code = False
        lines = path.read_text().split("\n")
        for i, line in enumerate(lines):
            if line.startswith("```"):
                in_code = not in_code
            if in_code or not line.startswith("|"):
                continue
            assert line.rstrip().endswith("|"), f"{path.name}:{i + 1}: a table row does not end its line"
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            assert nxt.startswith("|") or not nxt.strip() or "|" not in nxt, (
                f"{path.name}:{i + 2}: continues the table row above on a line of its own")


def test_package_data_ships_every_non_python_file_the_package_reads():
    """The C sources (CPU attention kernel, fused small ops) and the embedded checkpoints are
    read at run time from the installed package, so a non-editable install must carry them."""
    import fnmatch

    from minivllm.engine import model_check
    from minivllm.layers import cpu_fused
    from minivllm.layers.attention import cpu_decode

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["minivllm"]
    pkg = ROOT / "minivllm"
    c_sources = sorted(p for p in pkg.rglob("*") if p.suffix in (".c", ".h", ".cpp"))  # the model check's too
    assert cpu_decode.SOURCE in c_sources and cpu_fused.SOURCE in c_sources
    assert model_check.SOURCE in c_sources and model_check.TENSOR_DATA_SOURCE in c_sources
    for path in [*c_sources, *sorted((pkg / "assets").rglob("*.json"))]:
        rel = path.relative_to(pkg).as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel


def test_the_sdist_carries_what_its_tests_read_and_the_license():
    """The sdist had tests/test_*.py without conftest.py, helpers_*.py, tests/compat, the notebooks,
    scripts, environment.yml or .ci/run (38 collection errors unpacked), and no LICENSE anywhere
    though pyproject declared MIT. (Built and collected by hand: `python -m build`, then
    `pytest --co tests` in the unpacked sdist.)"""
    manifest = (ROOT / "MANIFEST.in").read_text().split("\n")
    for folder in ("tests", "notebooks", "scripts", "docs", ".ci"):
        assert f"graft {folder}" in manifest, folder
    included = " ".join(line for line in manifest if line.startswith("include "))
    for name in ("environment.yml", "LICENSE"):
        assert name in included.split() and (ROOT / name).is_file(), name
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert "MIT License" in (ROOT / "LICENSE").read_text()
