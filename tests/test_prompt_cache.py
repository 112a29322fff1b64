"""A PromptCache carries caches across calls without changing a single output token."""

import pytest

from dflash.model_mlx import PromptCache, generate


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_multi_turn_reuse_is_exact(kind, loaded_pair):
    model, tokenizer, draft = loaded_pair(kind)
    pc = PromptCache()
    messages = [{"role": "user", "content": "Name three rivers."}]
    previous_len = 0
    for turn in range(3):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        cached = generate(model, draft, tokenizer, prompt, max_tokens=30, block_size=4,
                          prompt_cache=pc)
        fresh = generate(model, draft, tokenizer, prompt, max_tokens=30, block_size=4)
        assert cached.tokens == fresh.tokens
        # From the second turn on, at least the previous prompt (a snapshot point) is reused.
        assert cached.stats.reused_prompt_tokens >= previous_len
        previous_len = len(prompt)
        messages += [{"role": "assistant", "content": cached.text},
                     {"role": "user", "content": f"And {turn + 2} more?"}]


def test_reuse_with_divergent_prompt_and_other_pair(loaded_pair):
    model, tokenizer, draft = loaded_pair("llama")
    pc = PromptCache()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    b = [1, 2, 3, 4, 5, 60, 70]
    generate(model, draft, tokenizer, a, max_tokens=12, prompt_cache=pc)
    out = generate(model, draft, tokenizer, b, max_tokens=12, prompt_cache=pc)
    assert out.stats.reused_prompt_tokens == 5
    assert out.tokens == generate(model, draft, tokenizer, b, max_tokens=12).tokens
    # Another model pair never picks up these caches.
    other_model, other_tok, other_draft = loaded_pair("qwen3")
    out = generate(other_model, other_draft, other_tok, b, max_tokens=12, prompt_cache=pc)
    assert out.stats.reused_prompt_tokens == 0
    assert out.tokens == generate(other_model, other_draft, other_tok, b, max_tokens=12).tokens


# ---------------------------------------------------------------------------------------------
# The reply stays in the cache; several conversations; bounds


def words(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def follow_up(tokenizer, prompt: list[int], reply: list[int], text: str) -> list[int]:
    """The next turn as an agent sends it: everything so far, then a new message."""
    return prompt + reply + words(tokenizer, text)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "llama"])
def test_the_reply_stays_in_the_cache(kind, loaded_pair):
    """Turn 2 prefills only its new message: the prompt and all of turn 1's reply but its last
    token (sampled, not yet fed) are served from the cache, and the output is a fresh run's."""
    model, tokenizer, draft = loaded_pair(kind)
    pc = PromptCache()
    prompt = words(tokenizer, "Write a function that reverses a list, then explain it.")
    first = generate(model, draft, tokenizer, prompt, max_tokens=24, block_size=4,
                     prompt_cache=pc)
    assert len(pc) == 1 and pc.entries()[0].tokens == prompt + first.tokens[:-1]
    second = follow_up(tokenizer, prompt, first.tokens, " Now make it return a copy.")
    cached = generate(model, draft, tokenizer, second, max_tokens=24, block_size=4,
                      prompt_cache=pc)
    assert cached.stats.reused_prompt_tokens == len(prompt) + len(first.tokens) - 1
    assert cached.tokens == generate(model, draft, tokenizer, second, max_tokens=24,
                                     block_size=4).tokens


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_interleaved_conversations_keep_their_own_entries(kind, loaded_pair):
    """A main agent and two sub-agents sharing a long system prompt, turns interleaved: each
    continuing turn finds its own conversation's reply, a new one starts from the shared system
    prompt, and every output is a fresh run's. A hybrid target (GatedDeltaNet states go back
    only to snapshots) snapshots where the first sub-agent stops sharing: the second starts
    there."""
    model, tokenizer, draft = loaded_pair(kind)
    pc = PromptCache()
    system = words(tokenizer, "You are a careful coding agent. Tools: read, edit, run. " * 3)
    convs = {name: system + [100 + i] + words(tokenizer, task) for i, (name, task) in
             enumerate({"main": " Fix the failing test.", "sub": " Summarise utils.py.",
                        "sub2": " List the imports."}.items())}
    hybrid, tail = kind == "qwen3_5", words(tokenizer, " Go on.")
    for turn in range(2):
        for name, prompt in list(convs.items()):
            out = generate(model, draft, tokenizer, prompt, max_tokens=12, prompt_cache=pc)
            assert out.tokens == generate(model, draft, tokenizer, prompt, max_tokens=12).tokens
            reused = out.stats.reused_prompt_tokens
            if turn == 1:  # its own reply is cached
                assert reused == len(prompt) - len(tail) - 1, name
            elif name == "main":
                assert reused == 0
            elif name == "sub":
                assert reused == (0 if hybrid else len(system))
            else:
                assert reused == len(system)
            convs[name] = prompt + out.tokens + tail
    assert len(pc) == 3


def test_least_recently_used_conversations_are_dropped_by_count_and_bytes(loaded_pair):
    model, tokenizer, draft = loaded_pair("llama")
    prompts = [[7 + i] + words(tokenizer, f" conversation {i} about boats and the sea")
               for i in range(3)]
    pc = PromptCache(max_entries=2)
    for p in prompts:
        generate(model, draft, tokenizer, p, max_tokens=8, prompt_cache=pc)
    assert len(pc) == 2 and [e.tokens[0] for e in pc.entries()] == [8, 9]
    again = generate(model, draft, tokenizer, prompts[0] + [5], max_tokens=4, prompt_cache=pc)
    assert again.stats.reused_prompt_tokens == 0  # evicted
    one = pc.entries()[-1].nbytes
    small = PromptCache(max_bytes=int(one * 1.5))
    for p in prompts:
        generate(model, draft, tokenizer, p, max_tokens=8, prompt_cache=small)
    assert len(small) == 1 and small.nbytes <= int(one * 1.5)
    assert small.entries()[0].tokens[0] == 9  # the newest kept
    with pytest.raises(Exception, match="max_entries"):
        PromptCache(max_entries=0)
    with pytest.raises(Exception, match="max_bytes"):
        PromptCache(max_bytes=-5)


def test_a_copy_of_a_long_conversation_is_independent(loaded_pair):
    """A bench replays each run from a copy of one prefilled cache: the copy of a 3000-token
    conversation (mlx-lm's token trie copied as it is recurses per token) serves the same
    reuse, and a generation from it leaves the original as it was."""
    import copy

    model, tokenizer, draft = loaded_pair("llama")
    prompt = [(7 * i) % 200 + 3 for i in range(3000)]
    pc = PromptCache()
    generate(model, draft, tokenizer, prompt, max_tokens=4, prompt_cache=pc)
    held = pc.entries()[0].tokens
    twin = copy.deepcopy(pc)
    assert len(twin) == 1 and twin.entries()[0].tokens == held
    assert twin.entries()[0].target[0] is not pc.entries()[0].target[0]
    longer = held + [5, 6, 7]
    out = generate(model, draft, tokenizer, longer, max_tokens=4, prompt_cache=twin)
    assert out.stats.reused_prompt_tokens == len(held)
    assert pc.entries()[0].tokens == held and pc.entries()[0].target[0].offset == len(held)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "llama"])
def test_the_batched_engine_keeps_every_reply(kind, loaded_pair):
    """The server's engine: three conversations decode together (rows leave the batch at
    different lengths, the last one alone), then each one's next turn reuses its prompt and
    reply, and every output is the target's alone."""
    from dflash.batch import BatchGenerator

    model, tokenizer, draft = loaded_pair(kind)
    pc = PromptCache()
    engine = BatchGenerator(model, draft, tokenizer, max_batch=3, prefill_chunk=32,
                            block_size=4, prompt_cache=pc)
    prompts = [words(tokenizer, f"Conversation {i}: explain how tides work near a harbour.")
               for i in range(3)]
    lengths = [6, 14, 22]

    def run(ps):
        uids = [engine.insert(p, max_tokens=m) for p, m in zip(ps, lengths)]
        tokens, stats = {u: [] for u in uids}, {}
        while engine.active or engine.pending:
            for e in engine.step():
                tokens[e.uid] += e.tokens
                stats[e.uid] = e.stats
        return [tokens[u] for u in uids], [stats[u] for u in uids]

    replies, _ = run(prompts)
    for p, r, m in zip(prompts, replies, lengths):
        assert r == generate(model, draft, tokenizer, p, max_tokens=m).tokens
    follow = [follow_up(tokenizer, p, r, " And at night?") for p, r in zip(prompts, replies)]
    again, stats = run(follow)
    for p, r, f, a, st, m in zip(prompts, replies, follow, again, stats, lengths):
        assert st.reused_prompt_tokens == len(p) + len(r) - 1
        assert a == generate(model, draft, tokenizer, f, max_tokens=m).tokens
