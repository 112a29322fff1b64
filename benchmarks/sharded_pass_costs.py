"""Per-pass costs of a target on one rank and tensor-parallel on two (``mlx.launch``, localhost).

The fixture has SmolLM2-135M's shapes (30 layers, hidden 576, MLP 1536, vocabulary 49152, tied
head) but 8 attention heads and 4 KV heads, which mlx-lm's tensor sharding can split over 2 ranks
(SmolLM2's 9 / 3 cannot); its weights are random, which does not change a pass's time. The
drafter is a random 2-layer DFlash drafter tapping 5 layers, as the built-in one.

Each repeat runs one process and then a launch of two ranks (the order alternates between
repeats), and each times the passes with :func:`dflash.cost_model.measure` (the calibration's own timing:
fastest of ``--rounds``): a verify pass of 1 to 16 rows at a 256-token context, a plain decode step
and a 16-row drafter pass. Rank 0 writes its times; the table shows the median over the repeats and
their spread (min-max).

    python benchmarks/sharded_pass_costs.py --repeats 3 --json pass_costs.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 2, 4, 8, 16)
SHAPE = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=49152, rms_norm_eps=1e-5,
             rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192)


def build_fixture(folder: Path) -> tuple[Path, Path]:
    """The SmolLM2-shaped target (even heads) and a drafter for it, written once."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import tiny_models

    target, draft = folder / "target", folder / "draft"
    if (draft / "config.json").is_file():
        return target, draft
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from dflash.default_pair import default_target_path

    target.mkdir(parents=True, exist_ok=True)
    source = default_target_path()
    config = dict(SHAPE)
    src = json.loads((source / "config.json").read_text())
    config.update(bos_token_id=src["bos_token_id"], eos_token_id=src["eos_token_id"])
    for name in tiny_models.TOKENIZER_FILES:
        shutil.copy(source / name, target / name)
    mx.random.seed(0)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.save_safetensors(str(target / "model.safetensors"),
                        {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())})
    (target / "config.json").write_text(json.dumps(config, indent=2))
    tiny_models.write_drafter(draft, target, layers=2, taps=(1, 8, 14, 20, 27), block_size=16,
                              extra={"num_attention_heads": 8, "num_key_value_heads": 4,
                                     "head_dim": 64, "intermediate_size": 1536})
    return target, draft


def worker(target: str, draft: str, out: str, rounds: int) -> None:
    """One launch: load the pair (sharded when there are two ranks), time its passes."""
    sys.path.insert(0, str(ROOT))
    from dflash import distributed
    from dflash.cost_model import measure
    from dflash.pair import load_pair
    from dflash.target import target_parts

    ranks = distributed.join()
    pair = load_pair(target, draft)
    model = measure(target_parts(pair.model), pair.draft, rows=list(ROWS), contexts=[256],
                    draft_rows=[16], rounds=rounds, quiet=True)
    if ranks.is_main:
        Path(out).write_text(json.dumps({
            "ranks": ranks.size, "verify_ms": dict(zip(ROWS, model.verify_ms[0])),
            "step_ms": model.step_ms[0], "draft16_ms": model.draft_ms[0]}))


def _spread(values: list[float]) -> str:
    values = sorted(values)
    return f"{values[len(values) // 2]:.2f} ({values[0]:.2f}-{values[-1]:.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="interleaved 1-rank/2-rank launches")
    p.add_argument("--rounds", type=int, default=5, help="timings per pass (fastest kept)")
    p.add_argument("--fixture", default=None, help="folder for the fixture (default: a temp dir)")
    p.add_argument("--json", default=None, help="write every launch's times here")
    p.add_argument("--worker", nargs=3, metavar=("TARGET", "DRAFT", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker, rounds=args.rounds)
        return 0
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        print("mlx.launch is not on PATH", file=sys.stderr)
        return 2
    folder = Path(args.fixture or tempfile.mkdtemp(prefix="dflash-sharded-"))
    target, draft = build_fixture(folder)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for rep in range(args.repeats):
        for n in ((1, 2) if rep % 2 == 0 else (2, 1)):
            out = folder / f"costs-{n}-{rep}.json"
            launch = [launcher, "-n", "2", "--backend", "ring"] if n == 2 else []
            subprocess.run([*launch, sys.executable, str(Path(__file__).resolve()),
                            "--rounds", str(args.rounds), "--worker", str(target), str(draft),
                            str(out)], check=True, env=env, cwd=ROOT)
            runs[n].append(json.loads(out.read_text()))
            print(f"repeat {rep + 1}: {n} rank(s) done", file=sys.stderr, flush=True)
    print(f"pass costs, ms: median over {args.repeats} repeats (min-max); 256-token context")
    print(f"{'pass':<16} {'1 rank':>22} {'2 ranks':>22} {'2 / 1':>7}")
    lines = [(f"verify {r} rows", [x["verify_ms"][str(r)] for x in runs[1]],
              [x["verify_ms"][str(r)] for x in runs[2]]) for r in ROWS]
    lines += [("plain step", [x["step_ms"] for x in runs[1]], [x["step_ms"] for x in runs[2]]),
              ("draft 16 rows", [x["draft16_ms"] for x in runs[1]],
               [x["draft16_ms"] for x in runs[2]])]
    for name, one, two in lines:
        ratio = sorted(two)[len(two) // 2] / sorted(one)[len(one) // 2]
        print(f"{name:<16} {_spread(one):>22} {_spread(two):>22} {ratio:>6.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": SHAPE, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
