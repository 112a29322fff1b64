"""GenerationSettings: one frozen object behind the API, the batched engine and the server."""

from __future__ import annotations

import dataclasses

import pytest
from test_engine import chat_prompt, reference

from dflash.batch import BatchGenerator, batch_generate
from dflash.errors import GenerationConfigError
from dflash.model_mlx import GenerationSettings, generate, stream_generate
from dflash.settings import ENGINE_HOME, FIELDS, POSITIONAL


def test_fields_are_the_whole_surface_and_frozen():
    s = GenerationSettings()
    assert set(POSITIONAL) <= FIELDS and set(ENGINE_HOME) <= FIELDS
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_tokens = 3
    with pytest.raises(TypeError):  # keyword-only
        GenerationSettings(16)
    assert s.changed() == {}
    t = s.replace(temperature=0.5, stop=["\n"])
    assert t.changed() == {"temperature": 0.5, "stop": ["\n"]} and s.temperature == 0.0


@pytest.mark.parametrize("fields, name", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"), ({"block_size": 1}, "block_size"),
    ({"policy": "greedy"}, "policy"), ({"min_confidence": 2.0}, "min_confidence"),
    ({"kv_bits": 7}, "kv_bits"), ({"stop": [""]}, "stop"), ({"memory": {}}, "memory"),
    ({"grammar": "{}"}, "grammar"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"proposal": "greedy"}, "proposal"), ({"seed": -1}, "seed")])
def test_a_bad_field_is_refused_when_made_naming_it(fields, name):
    with pytest.raises(GenerationConfigError, match=rf"^{name}\b"):
        GenerationSettings(**fields)
    with pytest.raises(GenerationConfigError, match=rf"^{name}\b"):  # and by replace
        GenerationSettings().replace(**fields)


def test_calls_map_positions_keywords_and_objects():
    s = GenerationSettings.from_call((8, 32, 0.5), top_k=4)
    assert (s.block_size, s.max_tokens, s.temperature, s.top_k) == (8, 32, 0.5, 4)
    base = GenerationSettings(max_tokens=10, temperature=0.7)
    assert GenerationSettings.from_call((), base, temperature=0.0).changed() == {"max_tokens": 10}
    assert GenerationSettings.from_call((), base) is base
    with pytest.raises(GenerationConfigError, match="^max_tokn: not a generation setting"):
        GenerationSettings.from_call(max_tokn=3)
    with pytest.raises(GenerationConfigError, match="^block_size: given both"):
        GenerationSettings.from_call((8,), block_size=4)
    with pytest.raises(GenerationConfigError, match="positional settings"):
        GenerationSettings.from_call(tuple(range(len(POSITIONAL) + 1)))
    with pytest.raises(GenerationConfigError, match="^settings="):
        GenerationSettings.from_call((), {"max_tokens": 3})


def test_one_object_serves_every_engine_as_the_keywords_do(loaded_pair):
    """The same settings given as an object and as keywords decode the same tokens on the
    single-sequence and the batched engine: the target's own greedy tokens."""
    model, tokenizer, draft = loaded_pair("llama")
    prompt = chat_prompt(tokenizer)
    ref = reference(model, prompt, n=24)
    settings = GenerationSettings(max_tokens=24, block_size=4)
    as_object = [t for r in stream_generate(model, draft, tokenizer, prompt, settings=settings)
                 for t in r.tokens]
    assert as_object == ref
    assert generate(model, draft, tokenizer, prompt, max_tokens=24, block_size=4).tokens == ref
    batched = batch_generate(model, draft, tokenizer, [prompt], block_size=4,
                             settings=settings.per_request())
    assert batched[0].tokens == ref
    engine = BatchGenerator(model, draft, tokenizer, block_size=4)
    with pytest.raises(GenerationConfigError, match="^block_size=4: a setting of the whole batch"):
        engine.insert(prompt, settings=settings)
    with pytest.raises(GenerationConfigError, match="^tree_budget=8: not a setting of Batch"):
        engine.insert(prompt, tree_budget=8)
