"""Constrained decoding (dflash.grammar): exact against mlx-lm with the same mask, valid answers.

Reference: mlx-lm's ``generate_step`` with the grammar's mask as a logits processor
(:func:`dflash.grammar.logits_processor`, llguidance's matcher, ``where(allowed, logits, -inf)``).
Greedy dflash output must be that token for token, through chains, plain steps, continuations
and the batched engine; sampled output's law is checked in test_sampling_stats.py.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance as llg
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from tiny_models import write_drafter, write_target

from dflash.batch import BatchGenerator, batch_generate
from dflash.errors import GenerationConfigError, GrammarError
from dflash.grammar import Grammar, logits_processor
from dflash.model_mlx import load_default
from dflash.speculative import generate
from dflash.stats import generation_stats
from dflash.target import target_parts

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
# Nested objects, arrays, numbers, enums and a string pattern.
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                               "price": {"type": "number"}},
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
            "minItems": 1, "maxItems": 3,
        },
        "status": {"enum": ["new", "paid", "shipped"]},
    },
    "required": ["id", "customer", "items", "status"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER}
QUESTIONS = {
    "person": "Describe Ann, a 31 year old who likes green, as JSON.",
    "order": "Write an example online shop order as JSON.",
}


@pytest.fixture(scope="module")
def builtin():
    model, tokenizer, draft = load_default()
    return model, tokenizer, draft


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True)


def reference(model, tokenizer, prompt: list[int], grammar: Grammar, n: int) -> list[int]:
    """mlx-lm's greedy tokens with the grammar's mask as a logits processor, cut at EOS."""
    bound = grammar.bind(tokenizer, target_parts(model).vocab_size)
    out = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                            logits_processors=[logits_processor(bound,
                                                                                len(prompt))])]
    eos = set(tokenizer.eos_token_ids)
    return out[:next((i for i, t in enumerate(out) if t in eos), len(out))]


def check_answer(text: str, schema: dict, finish: str) -> None:
    """A stopped answer is a valid document; one cut by max_tokens is a prefix of one."""
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert finish == "length"


# -- errors name the field ----------------------------------------------------------------------


class ByteTokens:
    """A tiny byte vocabulary for llguidance (7 ends the text)."""

    eos_token_id = 7
    bos_token_id = None
    tokens = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"<eos>"]
    special_token_ids = [7]

    def __call__(self, text) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        return [self.tokens.index(bytes([b])) for b in data if bytes([b]) in self.tokens]


def byte_tokenizer():
    return llg.LLTokenizer(llg.TokenizerWrapper(ByteTokens()))


@pytest.mark.parametrize(("make", "words"), [
    (lambda: Grammar.json_schema("{not json", field="response_format.json_schema.schema"),
     ["response_format.json_schema.schema", "not JSON"]),
    (lambda: Grammar.json_schema([1, 2], field="schema"), ["schema", "object"]),
    (lambda: Grammar.json_schema({"type": "objekt"}, field="schema"), ["schema", "objekt"]),
    (lambda: Grammar.json_schema({"type": "string", "format": "bogus"}, field="schema"),
     ["schema", "bogus"]),
    (lambda: Grammar.regex("[a-c](", field="regex"), ["regex", "unclosed group"]),
    (lambda: Grammar.regex("", field="regex"), ["regex"]),
    (lambda: Grammar.lark("start: nope", field="grammar"), ["grammar", "nope"]),
])
def test_bad_grammars_raise_naming_the_field(make, words):
    with pytest.raises(GrammarError) as err:
        make().bind(byte_tokenizer(), 8)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_masks_cut_and_force_proposals():
    """Row masks follow the proposals; a rejected proposal ends the chain; a forced token is
    proposed by the grammar itself; settle leaves exactly the emitted tokens consumed."""
    bound = Grammar.lark('start: ("a"|"b") "c" ("d"|"e")+').bind(byte_tokenizer(), 8)
    state = bound.start()
    c = state.constrain([0, 5, 3, 3], cap=4)  # a, (f: the grammar forces c), d, d
    assert c.tokens == [0, 2, 3, 3] and c.forced == 1
    allowed = np.array(state.allowed(c.bits))
    assert allowed[0].nonzero()[0].tolist() == [0, 1]
    assert allowed[1].nonzero()[0].tolist() == [2]
    assert allowed[2].nonzero()[0].tolist() == [3, 4]
    assert 7 in allowed[3].nonzero()[0].tolist()  # accepting: the end may come
    state.settle(c, accepted=1, bonus=2)  # the target kept "a", then chose "c"
    c2 = state.constrain([6, 4], cap=2)  # g is rejected: nothing to verify
    assert c2.tokens == [] and len(c2.bits) == 1
    state.settle(c2, accepted=0, bonus=4)
    assert state.matcher.is_accepting()


def test_sampled_proposals_keep_q_restricted_to_the_grammar():
    """A drawn proposal is accepted against ``q`` restricted to the allowed tokens (renormalised);
    a rejected one is redrawn from that restriction; no allowed mass ends the chain."""
    from dflash.sampling import RowDist

    bound = Grammar.lark('start: ("a"|"b") ("d"|"e")').bind(byte_tokenizer(), 8)
    q = [RowDist(np.array([0, 5, 1]), np.array([0.25, 0.5, 0.25])),  # a, f, b
         RowDist(np.array([6, 4]), np.array([0.5, 0.5])),  # g, e
         RowDist(np.array([6]), np.array([1.0]))]
    draws = []

    def draw(dist):
        draws.append(dist)
        return int(dist.ids[-1])

    state = bound.start()
    c = state.constrain([5, 6, 6], cap=3, q=q, draw=draw)  # f and g are rejected: redrawn
    assert c.tokens == [1, 4] and len(draws) == 2
    assert draws[0].ids.tolist() == [0, 1] and np.allclose(draws[0].probs, [0.5, 0.5])
    assert c.q[1].ids.tolist() == [4] and np.allclose(c.q[1].probs, [1.0])
    state.settle(c, accepted=0, bonus=0)
    c = state.constrain([6], cap=1, q=[q[2]], draw=draw)  # g only: no allowed mass, no proposal
    assert c.tokens == [] and len(draws) == 2


def test_an_end_of_text_proposal_is_never_consumed_tentatively():
    """llguidance's roll-back over a consumed end of text does not restore the state before it:
    an end-of-text proposal stays unconsumed until the target accepts it."""
    bound = Grammar.lark('start: "a" ("b"|"c")').bind(byte_tokenizer(), 8)
    state = bound.start()
    c = state.constrain([0, 1, 7, 7], cap=4)
    assert c.tokens == [0, 1, 7] and c.pending_end
    state.settle(c, accepted=1, bonus=2)  # the target kept "a", then chose "c"
    fresh = bound.start()
    fresh.matcher.consume_tokens([0, 2])
    assert (state.bits() == fresh.bits()).all() and state.committed == [0, 2]
    ended = bound.start()
    c = ended.constrain([0, 1, 7], cap=3)
    ended.settle(c, accepted=3, bonus=7)  # all accepted: a, b, the end, and the end again
    assert ended.committed == [0, 1, 7, 7] and ended.dead is None


def test_tree_nodes_get_their_own_paths_masks_and_rejected_ones_are_cut():
    """Each node's mask is the state after its own path; a node whose token its parent's state
    rejects is cut with its subtree, and the matcher is left at the emitted tokens."""
    from dflash.tree import DraftTree

    bound = Grammar.lark('start: "a" "b" | "b" "a"').bind(byte_tokenizer(), 8)
    state = bound.start()
    #        root 5 ─ a(1) ─ b(4)      c(2): rejected, with its child a(5)
    #               ├ c(2) ─ a(5)      b(3) ─ a(6)
    #               └ b(3) ─ a(6)
    tree = DraftTree([5, 0, 2, 1, 1, 0, 0], [-1, 0, 0, 0, 1, 2, 3], [0, 1, 1, 1, 2, 2, 2],
                     [0.0] * 7)
    kept, bits = state.tree(tree)
    assert kept == [0, 1, 3, 4, 6]
    allowed = [{t for t in range(8) if state.allows(b, t)} for b in bits]
    assert allowed == [{0, 1}, {1}, {0}, {7}, {7}]  # a -> b; b -> a; then only the end
    assert (state.bits() == bound.start().bits()).all()  # left as it was
    sub = tree.subtree(kept)
    assert sub.tokens == [5, 0, 1, 1, 0] and sub.parents == [-1, 0, 0, 1, 2]
    state.settle_path([1, 0], 7)  # the walk took b, a; the target then ended
    assert state.committed == [1, 0, 7] and state.dead is None


def test_tree_policy_with_a_grammar_equals_mlx_lm_with_the_mask(builtin):
    model, tokenizer, draft = builtin
    prompt = chat(tokenizer, QUESTIONS["person"])
    grammar = Grammar.json_schema(PERSON)
    out = generate(model, draft, tokenizer, prompt, max_tokens=48, grammar=grammar,
                   policy="tree")
    assert out.tokens == reference(model, tokenizer, prompt, grammar, 48)
    check_answer(out.text, PERSON, out.finish_reason)
    assert out.stats.tree_cycles > 0


def test_foreign_grammar_objects_are_refused(builtin):
    model, tokenizer, draft = builtin
    with pytest.raises(GenerationConfigError, match="grammar="):
        generate(model, draft, tokenizer, "hi", max_tokens=4, grammar={"type": "object"})


# -- greedy: identical to mlx-lm with the same mask ---------------------------------------------


def test_greedy_schema_answer_equals_mlx_lm_with_the_mask(builtin):
    model, tokenizer, draft = builtin
    grammar = Grammar.json_schema(PERSON)
    prompt = chat(tokenizer, QUESTIONS["person"])
    ref = reference(model, tokenizer, prompt, grammar, 48)
    out = generate(model, draft, tokenizer, prompt, max_tokens=48, grammar=grammar)
    assert out.tokens == ref
    check_answer(out.text, PERSON, out.finish_reason)
    assert out.stats.cycles > 0 and out.stats.forced_tokens > 0  # keys forced for free


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("policy", ["auto", "fixed"])
def test_greedy_schemas_equal_mlx_lm(name, policy, builtin):
    model, tokenizer, draft = builtin
    schema = SCHEMAS[name]
    grammar = Grammar.json_schema(schema)
    prompt = chat(tokenizer, QUESTIONS[name])
    ref = reference(model, tokenizer, prompt, grammar, 160)
    out = generate(model, draft, tokenizer, prompt, max_tokens=160, grammar=grammar,
                   policy=policy)
    assert out.tokens == ref
    check_answer(out.text, schema, out.finish_reason)
    if policy == "auto" and name == "order":  # its items repeat: context continuations ran
        assert out.stats.lookup_cycles > 0, out.stats
    if policy == "fixed":
        assert out.stats.forced_tokens > 0


@pytest.mark.slow
def test_greedy_regex_and_json_object_equal_mlx_lm(builtin):
    model, tokenizer, draft = builtin
    for grammar, question in [
            (Grammar.regex(r"(Yes|No), because [a-z ]{5,40}\."), "Is the sea salty?"),
            (Grammar.json_object(), "Give me a JSON object about cats.")]:
        prompt = chat(tokenizer, question)
        ref = reference(model, tokenizer, prompt, grammar, 60)
        out = generate(model, draft, tokenizer, prompt, max_tokens=60, grammar=grammar)
        assert out.tokens == ref, grammar.kind


def test_sampled_answers_validate_and_max_tokens_says_length(builtin):
    model, tokenizer, draft = builtin
    grammar = Grammar.json_schema(PERSON)
    prompt = chat(tokenizer, QUESTIONS["person"])
    for seed in range(2):
        out = generate(model, draft, tokenizer, prompt, max_tokens=64, grammar=grammar,
                       temperature=0.8, seed=seed)
        check_answer(out.text, PERSON, out.finish_reason)
    cut = generate(model, draft, tokenizer, prompt, max_tokens=6, grammar=grammar)
    assert cut.finish_reason == "length" and len(cut.tokens) == 6


def test_unconstrained_requests_are_untouched(builtin):
    """No grammar: no matcher, and the same tokens as before (mlx-lm alone)."""
    model, tokenizer, draft = builtin
    prompt = chat(tokenizer, "Name three colours.")
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=16)]
    eos = set(tokenizer.eos_token_ids)
    ref = ref[:next((i for i, t in enumerate(ref) if t in eos), len(ref))]
    out = generate(model, draft, tokenizer, prompt, max_tokens=16)
    assert out.tokens == ref and out.stats.forced_tokens == 0


# -- batched rows: each with its own grammar, or none --------------------------------------------


def test_batched_rows_keep_their_own_grammars(builtin):
    model, tokenizer, draft = builtin
    person, order = Grammar.json_schema(PERSON), Grammar.json_schema(ORDER)
    prompts = [chat(tokenizer, QUESTIONS["person"]), chat(tokenizer, QUESTIONS["order"]),
               chat(tokenizer, "Name three colours.")]
    grammars = [person, order, None]
    n = 40
    engine = BatchGenerator(model, draft, tokenizer, max_batch=3)
    uids = [engine.insert(p, max_tokens=n, grammar=g) for p, g in zip(prompts, grammars)]
    tokens = {u: [] for u in uids}
    finish = {}
    while engine.active or engine.pending:
        for e in engine.step():
            tokens[e.uid] += e.tokens
            if e.finish_reason is not None:
                finish[e.uid] = e.finish_reason
    for uid, prompt, grammar in zip(uids, prompts, grammars):
        if grammar is None:
            ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]
            eos = set(tokenizer.eos_token_ids)
            ref = ref[:next((i for i, t in enumerate(ref) if t in eos), len(ref))]
        else:
            ref = reference(model, tokenizer, prompt, grammar, n)
        assert tokens[uid] == ref, grammar and grammar.source[:40]
    assert set(finish.values()) <= {"stop", "length"}


@pytest.mark.slow
def test_batched_sampled_answers_validate(builtin):
    model, tokenizer, draft = builtin
    prompts = [chat(tokenizer, QUESTIONS["person"])] * 3
    out = batch_generate(model, draft, tokenizer, prompts, max_tokens=80, temperature=0.9,
                         seed=3, grammar=Grammar.json_schema(PERSON))
    for r in out:
        check_answer(r.text, PERSON, r.finish_reason)


# -- a grammar that cannot go on ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 8-token target and its drafter, with the byte vocabulary above."""
    from mlx_lm.utils import load_model

    from dflash.drafter import load_draft

    root = tmp_path_factory.mktemp("grammar")
    tpath = write_target(root / "target", "qwen3", vocab_size=8, with_tokenizer=False,
                         hidden=32, layers=1, seed=3)
    dpath = write_drafter(root / "draft", tpath, layers=1, taps=(0,), block_size=4)
    model, _ = load_model(tpath)
    return model, load_draft(dpath)


def test_no_valid_continuation_stops_with_finish_reason_grammar(tiny):
    """"z" is no token: after "a" nothing is allowed. The answer ends there, with a message."""
    model, draft = tiny
    bound = Grammar.lark('start: "a" "z"').bind(byte_tokenizer(), 8)
    out = generate(model, draft, None, [1, 2, 3], max_tokens=8, grammar=bound)
    assert out.tokens == [0]
    assert out.finish_reason == "grammar" and out.stats.grammar_message
    # What a server answer's `dflash` field carries (every endpoint builds it from these stats).
    assert generation_stats(out.stats)["grammar_message"] == out.stats.grammar_message


@pytest.mark.parametrize("max_batch", [1, 2])
def test_tiny_grammar_holds_on_every_path(tiny, max_batch):
    """Sampled, through chains and plain steps, alone and batched: every answer is the
    grammar's."""
    model, draft = tiny
    bound = Grammar.lark('start: ("a"|"b") "c" ("d"|"e"|"a")+').bind(byte_tokenizer(), 8)
    pattern = __import__("re").compile(r"[ab]c[dea]+")
    out = batch_generate(model, draft, None, [[1, 2, 3], [3, 2], [4]], max_batch=max_batch,
                         max_tokens=6, temperature=1.0, seed=0, grammar=bound)
    for r in out:
        text = "".join("abcdefg"[t] if t < 7 else "$" for t in r.tokens)
        assert pattern.fullmatch(text.rstrip("$")), text


# -- dflash generate --json-schema / --regex ------------------------------------------------------


def _run_cli(*args, timeout=300):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    env.pop("DFLASH_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "dflash", *map(str, args)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, encoding="utf-8", env=env, timeout=timeout)


def test_generate_grammar_options_fail_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for args, words in [(["--json-schema", tmp_path / "missing.json"], "missing.json"),
                        (["--json-schema", bad], "not JSON"),
                        (["--regex", "a", "--json-object"], "not allowed with")]:
        p = _run_cli("generate", "--prompt", "x", *args)
        assert p.returncode in (1, 2) and "Traceback" not in p.stderr, p.stderr
        assert words in p.stderr, p.stderr


@pytest.mark.slow
def test_generate_json_schema_and_regex_match_the_library(tiny_pair, loaded_pair, tmp_path):
    """The CLI's answer is the library's with the same grammar (tiny llama pair)."""
    from dflash.prompts import encode_prompt

    target, draft_path = tiny_pair("llama")
    model, tokenizer, draft = loaded_pair("llama")
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    ids = encode_prompt(tokenizer, {"prompt": "Who?"})
    for option, value, grammar in [("--json-schema", schema, Grammar.json_schema(PERSON)),
                                   ("--regex", "[a-z]{3,9}!", Grammar.regex("[a-z]{3,9}!"))]:
        expected = generate(model, draft, tokenizer, ids, max_tokens=40, grammar=grammar)
        p = _run_cli("generate", "--model", target, "--draft", draft_path, "--prompt", "Who?",
                     "--max-tokens", 40, "--json", "--no-speedup-estimate", option, value)
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert out["tokens"] == expected.tokens and out["text"] == expected.text
    p = _run_cli("generate", "--model", target, "--draft", draft_path, "--prompt", "Who?",
                 "--regex", "[a-(")
    assert p.returncode == 1 and "--regex" in p.stderr and "Traceback" not in p.stderr


# -- a DFlash2 drafter (its own proposal walk) ----------------------------------------------------


def test_dflash2_drafter_with_a_grammar_equals_mlx_lm(tiny_pair, tmp_path):
    """DFlash2 proposals come from its selector's walk (argmax greedy, drawn with their q when
    sampled): cut, replaced and forced like v1's, still mlx-lm's output."""
    from dflash2_fixtures import write_dflash2_drafter

    from dflash.drafter import load_draft
    from dflash.model_mlx import load

    target, v1 = tiny_pair("llama")
    model, tokenizer = load(str(target))
    draft = load_draft(str(write_dflash2_drafter(tmp_path / "draft", v1, sliding_window=16)))
    prompt = [1, 17, 42, 5, 99, 3, 8, 250, 31, 77]
    grammar = Grammar.json_schema(PERSON)
    ref = reference(model, tokenizer, prompt, grammar, 40)
    for policy in ("fixed", "auto"):
        out = generate(model, draft, tokenizer, prompt, max_tokens=40, grammar=grammar,
                       policy=policy)
        assert out.tokens == ref, policy
    sampled = generate(model, draft, tokenizer, prompt, max_tokens=60, grammar=grammar,
                       temperature=1.0, seed=2)
    check_answer(sampled.text, PERSON, sampled.finish_reason)
