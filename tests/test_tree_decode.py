"""Draft trees through the decode loop: greedy output stays the target's own, for every budget, and
when the accepted path runs through runner-up branches at any depth; the ``auto`` policy stays
exact on every target kind; ``policy="tree"`` refuses hybrid targets."""

from __future__ import annotations

import pytest
from test_engine import N_TOKENS, references  # noqa: F401  (a fixture)
from tiny_models import RankedOracleDrafter

from dflash import speculative
from dflash.cost_model import cost_model
from dflash.errors import GenerationConfigError
from dflash.model_mlx import generate, stream_generate
from dflash.target import target_parts

ATTENTION_KINDS = ("qwen3", "llama")
BLOCK = 8

# rank(cycle, j): where the true token of block row j sits among the drafter's candidates.
RANKS = {
    # Runner-up at one depth, moving through every depth from cycle to cycle.
    "rank1-each-depth": (lambda c, j: 1 if j == c % (BLOCK - 1) else 0, 16),
    # Third choice at one depth.
    "rank2-each-depth": (lambda c, j: 2 if j == (3 * c) % (BLOCK - 1) else 0, 24),
    # Runner-up at one depth and third choice deeper: a path through two non-first branches.
    "two-depths": (lambda c, j: 1 if j == c % 3 else 2 if j == 3 + c % 4 else 0, 31),
}


def first_planted(rank, cycle: int) -> int | None:
    return next((j for j in range(BLOCK - 1) if rank(cycle, j)), None)


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "qwen3" else k
                                  for k in ATTENTION_KINDS])  # one attention family fast
@pytest.mark.parametrize("budget", [pytest.param(1, marks=pytest.mark.slow), 4,
                                    pytest.param(16, marks=pytest.mark.slow)])
def test_tree_greedy_equals_target_alone(kind, budget, loaded_pair, references):  # noqa: F811
    model, tokenizer, draft = loaded_pair(kind)
    prompt, ref = references(kind)
    out = generate(model, draft, tokenizer, prompt, max_tokens=N_TOKENS, policy="tree",
                   tree_budget=budget)
    assert out.tokens == ref
    # Every drafting cycle verified a tree (a last cycle with one token left drafts nothing).
    assert out.stats.tree_cycles >= out.stats.cycles - 1 and out.stats.plain_steps == 0
    assert out.stats.rows_per_pass <= budget + 1


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
@pytest.mark.parametrize("plant", [p if p == "rank1-each-depth" else pytest.param(p, marks=pytest.mark.slow)
                                   for p in RANKS])
def test_tree_accepts_through_runner_up_branches_and_stays_exact(kind, plant, loaded_pair,
                                                                 references):  # noqa: F811
    model, tokenizer, draft = loaded_pair(kind)
    prompt, ref = references(kind)
    cost_model(target_parts(model), draft)  # measured (if at all) with the real drafter
    rank, budget = RANKS[plant]
    oracle = RankedOracleDrafter(draft, prompt + ref + [0] * 32, rank)
    responses = list(stream_generate(model, oracle, tokenizer, prompt, max_tokens=N_TOKENS,
                                     block_size=BLOCK, policy="tree", tree_budget=budget))
    assert [t for r in responses for t in r.tokens] == ref
    last = responses[-1]
    assert last.tree_cycles >= last.cycles - 1 and last.plain_steps == 0
    # Response i (after the prefill's) closes drafter cycle i - 1. A chain stops at the first row
    # whose true token is not the drafter's best; the tree went past it, and past the next row.
    beyond = sum(r.accepted >= first_planted(rank, c) + 2
                 for c, r in enumerate(responses[1:]) if first_planted(rank, c) is not None)
    planted = sum(first_planted(rank, c) is not None for c in range(len(responses) - 1))
    assert beyond >= 0.8 * planted, (beyond, planted)
    chain = generate(model, RankedOracleDrafter(draft, prompt + ref + [0] * 32, rank), tokenizer,
                     prompt, max_tokens=N_TOKENS, block_size=BLOCK, policy="fixed")
    assert chain.tokens == ref
    assert last.mean_tau > chain.stats.mean_tau + 1.5, (last.mean_tau, chain.stats.mean_tau)


def test_tree_walk_takes_non_first_branches_at_several_depths(loaded_pair, references,  # noqa: F811
                                                              monkeypatch):
    """The accepted paths themselves: nodes of rank 1 and 2, at more than one depth."""
    model, tokenizer, draft = loaded_pair("qwen3")
    prompt, ref = references("qwen3")
    cost_model(target_parts(model), draft)
    walks = []

    def spy(tree, targets):
        path, bonus = walk(tree, targets)
        walks.append([(tree.depths[i], tree.ranks[i]) for i in path])
        return path, bonus

    walk = speculative.walk
    monkeypatch.setattr(speculative, "walk", spy)
    rank, budget = RANKS["two-depths"]
    out = generate(model, RankedOracleDrafter(draft, prompt + ref + [0] * 32, rank), tokenizer,
                   prompt, max_tokens=N_TOKENS, block_size=BLOCK, policy="tree",
                   tree_budget=budget)
    assert out.tokens == ref
    off_spine = {(d, r) for w in walks for d, r in w if r > 0}
    assert {r for _, r in off_spine} == {1, 2}
    assert len({d for d, _ in off_spine}) >= 4, off_spine
    # Paths through two non-first branches, accepted deeper than both.
    assert sum(sum(r > 0 for _, r in w) >= 2 and len(w) >= 6 for w in walks) >= 5


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_5"])
def test_auto_policy_with_runner_up_proposals_stays_exact(kind, loaded_pair,
                                                          references):  # noqa: F811
    model, tokenizer, draft = loaded_pair(kind)
    prompt, ref = references(kind)
    cost_model(target_parts(model), draft)
    for plant in ("rank1-each-depth", "two-depths"):
        oracle = RankedOracleDrafter(draft, prompt + ref + [0] * 32, RANKS[plant][0])
        out = generate(model, oracle, tokenizer, prompt, max_tokens=N_TOKENS, block_size=BLOCK,
                       policy="auto")
        assert out.tokens == ref, plant
        if kind == "qwen3_5":  # hybrid: chains only
            assert out.stats.tree_cycles == 0
    out = generate(model, draft, tokenizer, prompt, max_tokens=N_TOKENS, policy="auto",
                   block_size=16)
    assert out.tokens == ref


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_wrapped"])
def test_tree_policy_on_hybrid_target_names_chains(kind, loaded_pair, references):  # noqa: F811
    model, tokenizer, draft = loaded_pair(kind)
    prompt, _ = references(kind)
    with pytest.raises(GenerationConfigError, match="chains"):
        generate(model, draft, tokenizer, prompt, max_tokens=5, policy="tree")
