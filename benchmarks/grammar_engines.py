"""llguidance against xgrammar on this machine: mask time per token and JSON-schema coverage.

    pip install xgrammar          # pulls torch, transformers and triton (not a dflash dependency)
    python benchmarks/grammar_engines.py

Why dflash binds llguidance (docs/structured-outputs.md#which-grammar-engine): chosen by mask
time, schema coverage and what each engine needs installed. On this Linux machine xgrammar could
not be measured: its PyPI wheel requires torch (1.2 GB, the CUDA build, which needs cuDNN and
NCCL wheels of several GB more), and torch installed without them broke `transformers`' import,
and with it mlx-lm's tokenizer (libcudnn.so.9 missing); on a Mac, torch installs without CUDA and
the script compares both. Both engines replay the same token sequences -- one valid
answer per schema of benchmarks/structured_outputs.py, tokenized by the built-in target's
tokenizer (SmolLM2, 49,152 ids) -- and time, per token, the next-token mask and one consume.
Coverage: a list of JSON-schema features, each compiled by both engines; a feature counts as
enforced only if the engine compiles it without a warning AND rejects an instance that breaks it
(an engine that ignores a keyword would otherwise pass it silently).
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from dflash.model_mlx import load_default

# One valid answer per schema of benchmarks/structured_outputs.py (compact JSON layout).
ANSWERS = {
    "person": {"name": "Ann Lee", "age": 31, "email": "ann.lee@mail.com", "colour": "green"},
    "order": {"id": "AB-123", "customer": {"name": "Bo", "vip": True},
              "items": [{"sku": "X1", "qty": 2, "price": 9.5},
                        {"sku": "Y2", "qty": 1, "price": 20.0}], "status": "paid"},
    "recipe": {"title": "Pancakes", "minutes": 20, "ingredients": ["flour", "milk", "eggs"],
               "vegetarian": True},
    "answer": {"reasoning": "3 boxes of 4 is 12, and 24 - 12 = 12.", "answer": 12},
}

# (feature, schema, a valid instance, an instance that breaks only that feature)
FEATURES = [
    ("enum", {"enum": ["a", "b"]}, "a", "c"),
    ("const", {"const": 3}, 3, 4),
    ("integer bounds", {"type": "integer", "minimum": 1, "maximum": 9}, 5, 12),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 1.5, 0),
    ("string pattern", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "AB-123", "ab-123"),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
    ("format email", {"type": "string", "format": "email"}, "a@b.com", "not an email"),
    ("format date", {"type": "string", "format": "date"}, "2026-12-07", "07/12/2026"),
    ("format uuid", {"type": "string", "format": "uuid"},
     "123e4567-e89b-12d3-a456-426614174000", "123"),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                           "maxItems": 2}, [1], [1, 2, 3]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "items": False}, [1, "a"], ["a", 1]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     [1, 2], [1, 1]),
    ("required + additionalProperties", {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "x", None),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, 4, 2),
    ("$ref / $defs", {"$defs": {"n": {"type": "integer"}}, "type": "array",
                      "items": {"$ref": "#/$defs/n"}}, [1, 2], ["x"]),
    ("recursive $ref", {"$defs": {"t": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
        "additionalProperties": False}}, "$ref": "#/$defs/t"},
     {"kids": [{"kids": []}]}, {"kids": [{"x": 1}]}),
    ("patternProperties", {"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                           "additionalProperties": False}, {"n_a": 1}, {"x": 1}),
    ("minProperties", {"type": "object", "minProperties": 1}, {"a": 1}, {}),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 10, 7),
    ("not", {"not": {"type": "string"}}, 1, "a"),
    ("if/then/else", {"if": {"type": "integer"}, "then": {"minimum": 0}}, 1, -1),
]


def compact(value) -> str:
    return json.dumps(value, separators=(", ", ": "))


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        from dflash.grammar import WHITESPACE, grammar_tokenizer
        self.llg, self.tok = llguidance, grammar_tokenizer(tokenizer, vocab_size)
        self.defaults = WHITESPACE["compact"]

    def compile(self, schema: dict):
        spec = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                           defaults=self.defaults)
        is_error, messages = self.llg.LLMatcher.validate_grammar_with_warnings(spec, self.tok)
        if is_error or messages:
            raise ValueError("; ".join(messages))
        return spec

    def matcher(self, spec):
        return self.llg.LLMatcher(self.tok, spec)

    def accepts(self, spec, ids: list[int]) -> bool:
        m = self.matcher(spec)
        return m.consume_tokens(ids) and m.is_accepting()

    def time_mask(self, spec, ids: list[int]) -> tuple[list[float], list[float]]:
        m = self.matcher(spec)
        out = np.empty((self.tok.vocab_size + 31) // 32, dtype=np.int32)
        masks, consumes = [], []
        for t in ids:
            s = time.perf_counter()
            m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)  # as dflash.grammar does
            masks.append(time.perf_counter() - s)
            s = time.perf_counter()
            m.consume_token(t)
            consumes.append(time.perf_counter() - s)
        return masks, consumes


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer._tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(", ", ": "))

    def accepts(self, compiled, ids: list[int]) -> bool:
        return _xgr_accepts(self.xgr.GrammarMatcher(compiled), ids)

    def time_mask(self, compiled, ids: list[int]) -> tuple[list[float], list[float]]:
        m = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        masks, consumes = [], []
        for t in ids:
            s = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - s)
            s = time.perf_counter()
            m.accept_token(t)
            consumes.append(time.perf_counter() - s)
        return masks, consumes


def _xgr_accepts(matcher, ids: list[int]) -> bool:
    """Whether xgrammar's matcher takes every id and may then end (its stop token allowed)."""
    for t in ids:
        if not matcher.accept_token(t):
            return False
    return matcher.is_completed() if hasattr(matcher, "is_completed") else matcher.can_terminate()


def engines(tokenizer, vocab_size: int) -> list:
    out = [Llguidance(tokenizer, vocab_size)]
    try:
        out.append(Xgrammar(tokenizer, vocab_size))
    except ImportError:
        print("xgrammar is not installed (pip install xgrammar): llguidance alone")
    return out


def main() -> None:
    from structured_outputs import SCHEMAS

    _, tokenizer, _ = load_default()
    vocab_size = 49152
    found = engines(tokenizer, vocab_size)
    print("mask time per token, median (p90) microseconds; consume per token, median")
    for name, (schema, _) in SCHEMAS.items():
        ids = tokenizer.encode(compact(ANSWERS[name]), add_special_tokens=False)
        cells = []
        for engine in found:
            compiled = engine.compile(schema)
            assert engine.accepts(compiled, ids), (engine.name, name)
            masks, consumes = engine.time_mask(compiled, ids)
            masks.sort()
            cells.append(f"{engine.name} {1e6 * statistics.median(masks):6.1f} "
                         f"({1e6 * masks[int(0.9 * (len(masks) - 1))]:6.1f}) / "
                         f"{1e6 * statistics.median(consumes):5.1f}")
        print(f"  {name:8s} {len(ids):3d} tokens   " + "   ".join(cells))
    print("\nJSON-schema features enforced (compiles without warning, takes the valid instance, "
          "refuses the broken one)")
    counts = {e.name: 0 for e in found}
    for feature, schema, good, bad in FEATURES:
        row = []
        for engine in found:
            try:
                compiled = engine.compile(schema)
                ok = engine.accepts(compiled, tokenizer.encode(compact(good),
                                                               add_special_tokens=False))
                refused = not engine.accepts(compiled, tokenizer.encode(
                    compact(bad), add_special_tokens=False))
                verdict = "yes" if ok and refused else ("ignored" if ok else "wrong")
            except Exception as e:  # noqa: BLE001 - an engine's refusal is a result here
                verdict = f"refused ({str(e).splitlines()[0][:40]})"
            counts[engine.name] += verdict == "yes"
            row.append(f"{engine.name}: {verdict}")
        print(f"  {feature:32s} " + "   ".join(row))
    print("  total: " + ", ".join(f"{k} {v}/{len(FEATURES)}" for k, v in counts.items()))


if __name__ == "__main__":
    np.set_printoptions(precision=2)
    main()
