"""Tap k is the output of decoder layer k (0-based), i.e. Hugging Face's hidden_states[k + 1]."""

import mlx.core as mx
import pytest
from conftest import KINDS

from dflash.target import forward, make_cache, target_parts


def layer_outputs(parts, tokens):
    """Run the layers one by one, without any cache: outputs[k] = output of layer k."""
    from mlx_lm.models.base import create_attention_mask

    h = parts.embed(tokens)
    mask = create_attention_mask(h, None)
    outputs = []
    for layer in parts.layers:
        h = layer(h, None if hasattr(layer, "linear_attn") else mask, cache=None)
        outputs.append(h)
    return outputs


@pytest.mark.parametrize("kind", KINDS)
def test_tap_is_output_of_layer_k_not_off_by_one(kind, loaded_pair):
    model, _, _ = loaded_pair(kind)
    parts = target_parts(model)
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    outputs = layer_outputs(parts, tokens)
    for k in range(parts.num_layers):
        _, taps = forward(parts, tokens, make_cache(parts), [k])
        assert mx.allclose(taps, outputs[k], atol=1e-4), f"tap {k} is not layer {k}'s output"
        for other in (k - 1, k + 1):
            if 0 <= other < parts.num_layers:
                assert not mx.allclose(taps, outputs[other], atol=1e-3)
    # Several taps concatenate along features in the order given.
    _, taps = forward(parts, tokens, make_cache(parts), [2, 0])
    assert mx.allclose(taps, mx.concatenate([outputs[2], outputs[0]], axis=-1), atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_logits_equal_the_model_call(kind, loaded_pair):
    model, _, _ = loaded_pair(kind)
    parts = target_parts(model)
    tokens = mx.array([[3, 14, 15, 92, 65, 35]])
    logits, _ = forward(parts, tokens, make_cache(parts), [0])
    assert mx.allclose(logits, model(tokens), atol=1e-4)
