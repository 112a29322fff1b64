"""Shared fixtures: tiny random models of each target family, built and loaded once per session.

Two tiers: `pytest -m "not slow" -n 2` (pure functions, CLI usage, sampling units and the
greedy-exactness runs per target family; 144 s on a 2-core machine, 256 s in one process) while
changing code; `scripts/test.sh` (what CI runs) runs both, the `slow` tests in one process.

Under pytest-xdist each worker's BLAS runs one thread: the tiny models' passes gain nothing from
more, and two workers with a thread per core each would fight over the cores (the fast tier took
193 s with -n 2 and OpenBLAS's default threads).
"""

import errno
import os
import subprocess
import sys
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):  # before any BLAS loads
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(name, "1")

import pytest  # noqa: E402

from dflash.backend import configure  # noqa: E402

configure()  # OpenBLAS bound as mlx.core loads, before any test module imports it
sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402

KINDS = ("qwen3", "qwen3_5", "qwen3_5_wrapped", "llama")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_pair(tiny_root):
    """``tiny_pair(kind)`` -> (target_path, draft_path), built once per session."""
    made = {}

    def make(kind: str):
        if kind not in made:
            target = tiny_models.write_target(tiny_root / kind / "target", kind)
            draft = tiny_models.write_drafter(tiny_root / kind / "draft", target, taps=(0, 2))
            calibrated(target, draft)
            made[kind] = (target, draft)
        return made[kind]

    return make


def calibrated(target: Path, draft: Path) -> None:
    """The pair's pass costs written once under DFLASH_HOME as a fixed table (the calibration
    file ``dflash calibrate`` would write), so that the auto policy of every test, in this
    process or a ``dflash`` subprocess, prices with the same costs on every machine and under
    any load: what a test asserts about the policy's choices must not depend on timings. The
    table has the shape of a small model's passes: per-pass overhead, each extra row ~6 %."""
    from dflash import cost_model as costs
    from dflash.model_mlx import load, load_draft
    from dflash.target import target_parts

    model, _ = load(str(target))
    parts, drafter = target_parts(model), load_draft(str(draft))
    key = costs.cost_key(parts, drafter)
    verify = [[(1.0 + 0.1 * i) * (1.0 + 0.06 * (r - 1)) for r in costs.ROWS]
              for i in range(len(costs.CONTEXTS))]  # a little dearer at each longer context
    table = costs.CostModel(key=key, machine=costs.machine_id(), rows=list(costs.ROWS),
                            contexts=list(costs.CONTEXTS), verify_ms=verify,
                            draft_rows=list(costs.DRAFT_ROWS),
                            draft_ms=[0.3 + 0.02 * r for r in costs.DRAFT_ROWS],
                            measured_at="fixed by the test suite",
                            step_ms=[row[0] for row in verify])
    path = costs.calibration_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(costs.to_json(table))
    costs.cost_model(parts, drafter).calibrated = table


@pytest.fixture(scope="session")
def loaded_pair(tiny_pair):
    """``loaded_pair(kind)`` -> (model, tokenizer, draft), loaded once per session."""
    from dflash.model_mlx import load, load_draft

    loaded = {}

    def get(kind: str):
        if kind not in loaded:
            target, draft = tiny_pair(kind)
            model, tokenizer = load(str(target))
            loaded[kind] = (model, tokenizer, load_draft(str(draft)))
        return loaded[kind]

    return get


# ---------------------------------------------------------------------------------------------
# The server tests (test_server*.py): each module starts its own `server` (a dict with `base`);
# these fixtures serve any of them.

SERVER_KIND = "llama"  # the tiny pair the server tests serve


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the module's running ``server``."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def reference(loaded_pair):
    """Greedy (or seeded) output of the library itself for a chat or a raw prompt."""
    import threading

    from dflash.model_mlx import generate
    from dflash.prompts import encode_prompt

    model, tokenizer, draft = loaded_pair(SERVER_KIND)
    lock = threading.Lock()

    def ref(messages=None, prompt=None, max_tokens=24, **kwargs):
        ids = encode_prompt(tokenizer, {"messages": messages}) if messages is not None else prompt
        with lock:
            r = generate(model, draft, tokenizer, ids, max_tokens=max_tokens, **kwargs)
        n_prompt = len(ids) if messages is not None else r.stats.prompt_tokens
        return r.text, r.tokens, n_prompt

    return ref


class SmallDisk:
    """A real, small file system (tmpfs) that a test fills to the last byte, as a disk fills up
    under a running job: from then on every write that needs space fails with ENOSPC."""

    def __init__(self, path: Path):
        self.path = path
        self.filler = path / "filler"

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for chunk in (1 << 20, 1 << 12, 1):  # big chunks, then the last page, then bytes
                while True:
                    try:
                        os.write(fd, b"\0" * chunk)
                    except OSError as e:
                        assert e.errno == errno.ENOSPC, e
                        break
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink()


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs mounted for the test (needs the right to mount: root; skipped without)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        yield SmallDisk(disk)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)
