"""The ``dflash`` command line, run as ``python -m dflash ...`` on tiny models."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash import cli

ROOT = Path(__file__).resolve().parents[1]
KIND = "llama"
ENV = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1")
ENV.pop("DFLASH_DEBUG", None)


def run(*args, input=None, timeout=180, env=None):
    return subprocess.run([sys.executable, "-m", "dflash", *map(str, args)], cwd=ROOT,
                          input=input, capture_output=True, text=True, encoding="utf-8",
                          env=dict(ENV, **(env or {})), timeout=timeout)


def one_error_line(p, code=1):
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, p.stderr
    return errors[0]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return tiny_pair(KIND)


@pytest.fixture(scope="module")
def library(loaded_pair):
    """The library's own output for a chat prompt, for comparison."""
    from dflash.model_mlx import generate
    from dflash.prompts import encode_prompt

    model, tokenizer, draft = loaded_pair(KIND)

    def ref(text, **kwargs):
        ids = encode_prompt(tokenizer, {"prompt": text}, system=kwargs.pop("system", None))
        return generate(model, draft, tokenizer, ids, **kwargs)

    return ref


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"dflash {command}" in out and "--model" in out and "--draft" in out


def test_top_level_help_lists_everything(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("generate", "chat", "serve", "bench", "convert", "datagen", "train"):
        assert command in out
    assert cli.main([]) == 2


def test_generate_help_lists_every_engine_setting(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = capsys.readouterr().out
    for option in ("--temperature", "--top-p", "--top-k", "--min-p", "--repetition-penalty",
                   "--repetition-context-size", "--presence-penalty", "--frequency-penalty",
                   "--seed", "--proposal", "--max-tokens", "--block-size", "--system",
                   "--enable-thinking", "--no-enable-thinking", "--no-chat-template", "--json",
                   "--stop", "--prompt", "--min-confidence"):
        assert option in out, option


def test_missing_external_subcommand_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(cli.EXTERNAL, "convert",
                        ("dflash.no_such_module", "add_convert_args", "run_convert", "x"))
    assert cli.main(["convert", "--hf-path", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not available" in err[0]
    monkeypatch.setitem(cli.EXTERNAL, "train", ("dflash.cli", "add_nothing", "run_nothing", "x"))
    assert cli.main(["train", "--help"]) == 2
    assert "add_nothing" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_streams_the_library_output(pair, library):
    target, draft = pair
    expected = library("Tell me a story.", max_tokens=20)
    p = run("generate", "--model", target, "--draft", draft, "--prompt", "Tell me a story.",
            "--max-tokens", 20)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == expected.text.rstrip("\n")
    stats = p.stderr.strip().splitlines()[-1]
    for part in ("τ", "tok/s", "speed-up", "draft", "verify", "peak"):
        assert part in stats, stats


@pytest.mark.slow
def test_generate_json_and_stdin(pair, library):
    target, draft = pair
    expected = library("What is 2 + 2?", max_tokens=12, system="Be brief.")
    p = run("generate", "--model", target, "--draft", draft, "--max-tokens", 12, "--json",
            "--system", "Be brief.", input="What is 2 + 2?")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["text"] == expected.text and out["tokens"] == expected.tokens
    stats = out["stats"]
    assert stats["generation_tokens"] == len(expected.tokens)
    assert stats["cycles"] == expected.stats.cycles
    for key in ("mean_tau", "generation_tps", "prompt_tps", "draft_time", "verify_time",
                "peak_memory_gb", "acceptance_by_position", "speedup_estimate", "finish_reason"):
        assert key in stats, key


@pytest.mark.slow
def test_generate_sampling_options_reach_the_engine(pair, library):
    target, draft = pair
    settings = dict(temperature=0.7, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.1,
                    repetition_context_size=16, presence_penalty=0.2, frequency_penalty=0.1,
                    seed=3, proposal="sample", block_size=4, min_confidence=1.0)
    expected = library("Name a fruit.", max_tokens=12, **settings)
    args = []
    for k, v in settings.items():
        args += [f"--{k.replace('_', '-')}", v]
    p = run("generate", "--model", target, "--draft", draft, "--prompt", "Name a fruit.",
            "--max-tokens", 12, "--json", "--no-speedup-estimate", *args)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["tokens"] == expected.tokens
    assert len(out["stats"]["acceptance_by_position"]) == 3  # block size 4
    assert out["stats"]["verified_tokens"] == expected.stats.verified_tokens
    assert out["stats"]["verified_tokens"] <= out["stats"]["cycles"]  # min_confidence 1


@pytest.mark.slow
def test_generate_no_lookup_reaches_the_engine(pair, library):
    """The tiny target repeats itself, so by default the context's continuation is verified;
    ``--no-lookup`` verifies the drafter's proposals only. Same text either way."""
    target, draft = pair
    prompt = "Repeat: red blue red blue red blue red blue"
    expected = library(prompt, max_tokens=24)
    lookups = {}
    for flag in ("--no-lookup", None):
        p = run("generate", "--model", target, "--draft", draft, "--prompt", prompt,
                "--max-tokens", 24, "--json", "--no-speedup-estimate", *([flag] if flag else []))
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["tokens"] == expected.tokens
        lookups[flag] = out["stats"]["lookup_cycles"]
    assert lookups["--no-lookup"] == 0 < lookups[None]


@pytest.mark.slow
def test_generate_raw_prompt_without_template(pair, loaded_pair):
    from dflash.model_mlx import generate

    target, draft = pair
    model, tokenizer, d = loaded_pair(KIND)
    expected = generate(model, d, tokenizer, tokenizer.encode("Plain text"), max_tokens=8)
    p = run("generate", "--model", target, "--draft", draft, "--prompt", "Plain text",
            "--no-chat-template", "--no-enable-thinking", "--max-tokens", 8, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["tokens"] == expected.tokens


@pytest.mark.slow
def test_bad_paths_and_settings_give_one_line(pair, tmp_path):
    import tiny_models

    target, draft = pair
    one_error_line(run("generate", "--model", tmp_path / "missing", "--draft", draft,
                       "--prompt", "x"))
    one_error_line(run("generate", "--model", target, "--draft", tmp_path / "missing",
                       "--prompt", "x"))
    (tmp_path / "file").write_text("x")
    one_error_line(run("generate", "--model", tmp_path / "file", "--draft", draft, "--prompt", "x"))
    (tmp_path / "empty").mkdir()
    line = one_error_line(run("generate", "--model", tmp_path / "empty", "--draft", draft,
                              "--prompt", "x"))
    assert "config.json" in line
    # The target given as drafter, and a drafter given as target.
    one_error_line(run("generate", "--model", target, "--draft", target, "--prompt", "x"))
    one_error_line(run("generate", "--model", draft, "--draft", draft, "--prompt", "x"))
    # A drafter made for another target (other hidden size): incompatible.
    other = tiny_models.write_target(tmp_path / "other", "llama", hidden=32)
    other_draft = tiny_models.write_drafter(tmp_path / "other_draft", other)
    line = one_error_line(run("generate", "--model", target, "--draft", other_draft,
                              "--prompt", "x"))
    assert "does not fit" in line
    line = one_error_line(run("generate", "--model", target, "--draft", draft, "--prompt", "x",
                              "--top-p", 3))
    assert "top_p" in line
    line = one_error_line(run("generate", "--model", target, "--draft", draft, "--prompt", "x",
                              "--min-confidence", 2))
    assert "min_confidence" in line
    line = one_error_line(run("serve", "--model", tmp_path / "missing", "--draft", draft))
    assert "no such folder" in line
    line = one_error_line(run("serve", "--model", target, "--draft", draft,
                              "--max-concurrency", 0), code=2)
    assert "--max-concurrency 0" in line
    line = one_error_line(run("bench", "--model", target, "--draft", draft, "--concurrency", 1,
                              "--max-batch", 0), code=2)
    assert "--max-batch 0" in line
    one_error_line(run("bench", "--model", target, "--draft", draft, "--prompts",
                       tmp_path / "none.jsonl"))
    one_error_line(run("bench", "--model", target, "--draft", draft, "--block-size", "4,x"),
                   code=2)


@pytest.mark.slow
def test_serve_that_cannot_load_exits_1_every_time(pair, tmp_path):
    # The worker thread ran MLX before the error (the target loads, then the drafter does not
    # fit): its MLX stream once outlived it and aborted the exit at random (exit 134).
    import tiny_models

    target, _ = pair
    other = tiny_models.write_target(tmp_path / "other", "llama", hidden=32)
    other_draft = tiny_models.write_drafter(tmp_path / "other_draft", other)
    for _ in range(4):
        line = one_error_line(run("serve", "--model", target, "--draft", other_draft))
        assert "does not fit" in line
    for _ in range(2):
        line = one_error_line(run("serve", "--model", tmp_path / "missing"))
        assert "no such folder" in line


@pytest.mark.slow
def test_chat_multi_turn_reset_and_stats(pair, loaded_pair):
    from dflash.model_mlx import generate
    from dflash.prompts import encode_prompt

    target, draft = pair
    model, tokenizer, d = loaded_pair(KIND)
    first = generate(model, d, tokenizer, encode_prompt(
        tokenizer, {"messages": [{"role": "user", "content": "Hello"}]}), max_tokens=6).text
    second = generate(model, d, tokenizer, encode_prompt(tokenizer, {"messages": [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
        {"role": "user", "content": "More"}]}), max_tokens=6).text
    fresh = generate(model, d, tokenizer, encode_prompt(
        tokenizer, {"messages": [{"role": "user", "content": "More"}]}), max_tokens=6).text
    p = run("chat", "--model", target, "--draft", draft, "--max-tokens", 6,
            input="Hello\nMore\n/stats\n/reset\nMore\n/exit\n")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == first and lines[1] == second  # the second turn saw the first
    assert lines[2].startswith("[conversation: 2 answers")
    assert any("acceptance by block position" in line for line in lines)
    i = lines.index("[conversation cleared]")
    assert lines[i + 1] == fresh
    assert p.stderr.count("[τ") == 3


@pytest.mark.slow
def test_bench_subcommand_writes_reports(pair, tmp_path):
    target, draft = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "prompt": "What is 3 + 4?"}) + "\n"
                       + json.dumps({"id": "p2", "messages": [
                           {"role": "user", "content": "Write a haiku."}]}) + "\n")
    out = tmp_path / "bench"
    p = run("bench", "--model", target, "--draft", draft, "--prompts", prompts, "--max-tokens", 8,
            "--block-size", "4,8", "--min-confidence", 0, "--out", out)
    assert p.returncode == 0, p.stderr
    assert "block 4:" in p.stdout and "block 8:" in p.stdout
    assert "identical at T=0: yes" in p.stdout
    assert "[1/6]" in p.stderr and "[6/6]" in p.stderr  # progress
    result = json.loads((out / "bench.json").read_text())
    assert result["identical"] is True
    assert [r["block_size"] for r in result["runs"]] == [4, 8]
    assert result["config"]["min_confidence"] == 0
    verified = [r["overall"]["verified_per_cycle"] for r in result["runs"]]
    assert verified[1] > verified[0] > 1.5  # whole blocks verified (short answers cut the last)
    for name in ("bench.md", "speedup.png", "acceptance.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.slow
def test_ctrl_c_exits_130_without_traceback(pair):
    target, draft = pair
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash", "generate", "--model", str(target), "--draft",
         str(draft), "--prompt", "Go on and on.", "--max-tokens", "4000"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
        # A test run started in the background inherits an ignored SIGINT (and Python then
        # installs no handler): give the child the default a terminal's Ctrl-C meets.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    os.set_blocking(proc.stdout.fileno(), False)
    got = b""
    while not got and time.time() < deadline and proc.poll() is None:
        got = proc.stdout.read(1) or b""
        time.sleep(0.05)
    assert got, "no output before the deadline"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"Traceback" not in err and b"interrupted" in err


# ---------------------------------------------------------------------------------------------
# calibrate


def calibration_table(stdout: str) -> tuple[dict[int, list[float]], dict[int, float]]:
    """``(verify rows -> [ms, x_step per context...], draft block rows -> ms)`` as printed."""
    verify, draft, section = {}, {}, None
    for line in stdout.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] in ("rows", "block_rows"):
            section = words[0]
        elif words[0].isdigit() and section == "rows":
            verify[int(words[0])] = [float(w) for w in words[1:]]
        elif words[0].isdigit() and section == "block_rows":
            draft[int(words[0])] = float(words[1])
    return verify, draft


def assert_table_matches(stdout: str, cached: dict) -> None:
    verify, draft = calibration_table(stdout)
    assert sorted(verify) == cached["rows"] and sorted(draft) == cached["draft_rows"]
    for i, rows in enumerate(cached["rows"]):
        for c, ms in enumerate(cached["verify_ms"]):
            assert verify[rows][2 * c] == pytest.approx(ms[i], abs=0.006)
            assert verify[rows][2 * c + 1] == pytest.approx(ms[i] / ms[0], abs=0.006)
    for n, ms in zip(cached["draft_rows"], cached["draft_ms"]):
        assert draft[n] == pytest.approx(ms, abs=0.006)


@pytest.mark.slow
def test_calibrate_prints_the_cached_cost_model_and_writes_a_plot(pair, tmp_path):
    target, draft = pair
    env = {"DFLASH_HOME": str(tmp_path / "home")}
    out = tmp_path / "out"
    p = run("calibrate", "--model", target, "--draft", draft, "--out", out, env=env)
    assert p.returncode == 0, p.stderr
    assert "measuring this machine's verify and draft costs" in p.stderr
    (cached_file,) = (tmp_path / "home" / "calibration").glob("*.json")
    cached = json.loads(cached_file.read_text())
    assert_table_matches(p.stdout, cached)
    assert json.loads((out / "calibration.json").read_text()) == cached
    assert (out / "calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Again: read from the cache, not measured; the same table.
    again = run("calibrate", "--model", target, "--draft", draft, env=env)
    assert again.returncode == 0 and "measuring" not in again.stderr, again.stderr
    assert again.stdout == p.stdout
    # --refresh measures again and replaces the cached file.
    fresh = run("calibrate", "--model", target, "--draft", draft, "--refresh", env=env)
    assert fresh.returncode == 0 and "measuring" in fresh.stderr, fresh.stderr
    assert_table_matches(fresh.stdout, json.loads(cached_file.read_text()))


@pytest.mark.slow
def test_calibrate_without_matplotlib_is_one_error_line(pair, tmp_path):
    target, draft = pair
    stub = tmp_path / "stub" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = {"DFLASH_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join([str(stub.parent), ENV.get("PYTHONPATH", "")])}
    p = run("calibrate", "--model", target, "--draft", draft, "--out", tmp_path / "out", env=env)
    assert "matplotlib" in one_error_line(p)
    assert (tmp_path / "out" / "calibration.json").is_file()
    assert "rows" in p.stdout  # the table came first
