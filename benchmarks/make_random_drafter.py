"""A random-weight drafter for a target (default: the built-in SmolLM2): a drafter that never
agrees, for checking that the verify policy steps aside by itself (``dflash bench --draft``).

    python benchmarks/make_random_drafter.py OUT_DIR [--model PATH] [--layers 2] [--block-size 16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash.backend import configure
from dflash.drafter import DFlashConfig, DFlashDraftModel


def main() -> None:
    configure()  # OpenBLAS for the random weights' matmuls, as the loaders would
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.model is None:
        from dflash.default_pair import default_draft_path, default_target_path

        args.model = str(default_target_path())
        like = json.loads((default_draft_path() / "config.json").read_text())
    else:
        like = {}
    tcfg = json.loads((Path(args.model) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    hidden, vocab, n_layers = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["num_hidden_layers"]
    heads = tcfg.get("num_attention_heads", 8)
    taps = like.get("dflash_config", {}).get("target_layer_ids") or \
        sorted({round(1 + i * (n_layers - 4) / 4) for i in range(5)})
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": args.layers, "num_attention_heads": heads,
        "num_key_value_heads": tcfg.get("num_key_value_heads", heads),
        "head_dim": hidden // heads, "intermediate_size": tcfg.get("intermediate_size", 4 * hidden),
        "vocab_size": vocab, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "rope_theta": tcfg.get("rope_theta", 1e4), "num_target_layers": n_layers,
        "block_size": args.block_size, "tie_word_embeddings": False,
        "dflash_config": {"target_layer_ids": taps, "mask_token_id": vocab - 1},
    }
    mx.random.seed(args.seed)
    model = DFlashDraftModel(DFlashConfig.from_dict(cfg))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    print(out)


if __name__ == "__main__":
    main()
