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
