"""The guards of benchmarks/hf_llama.py: a transformers model is checkpointed once, with its KV cache
off (docs/failures.md #1 and #2), or refused in one line that names the fix."""

from __future__ import annotations

import pytest
from transformers.models.llama.modeling_llama import LlamaAttention

from benchmarks.hf_llama import (
    TINY,
    apply_ac_hf,
    build_hf_llama,
    enable_hf_gradient_checkpointing,
    random_batch,
    wrap_layers_fsdp1_style,
)
from errors import ConfigError
from tests.instruments import count_calls


def test_hf_gradient_checkpointing_is_refused() -> None:
    model = build_hf_llama(TINY)
    enable_hf_gradient_checkpointing(model, use_reentrant=True)
    with pytest.raises(ConfigError, match=r"gradient checkpointing on.*gradient_checkpointing_disable\(\)") as e:
        apply_ac_hf(model)
    assert len(e.value.problems) == 1 and "docs/failures.md #1" in str(e.value)


@pytest.mark.parametrize("wrap", ["checkpoint_wrapper", "apply_ac_hf"])
def test_already_checkpointed_layers_are_refused(wrap: str) -> None:
    model = build_hf_llama(TINY)
    if wrap == "checkpoint_wrapper":
        wrap_layers_fsdp1_style(model, reentrant=False)
    else:
        apply_ac_hf(model)
    with pytest.raises(ConfigError, match=r"already activation-checkpointed.*docs/failures.md #1") as e:
        apply_ac_hf(model)
    assert len(e.value.problems) == 1


def test_kv_cache_is_refused_then_each_layer_is_checkpointed_once() -> None:
    model = build_hf_llama(TINY, use_cache=True)
    # HF turns its KV cache off only under its own checkpointing: under ours it must be off already.
    with pytest.raises(ConfigError, match=r"use_cache is True.*docs/failures.md #2.*use_cache = False") as e:
        apply_ac_hf(model)
    assert len(e.value.problems) == 1

    model.config.use_cache = False
    names = [name for name, _ in model.named_parameters()]
    apply_ac_hf(model)
    assert [name for name, _ in model.named_parameters()] == names
    tokens = random_batch(TINY)
    with count_calls(model, LlamaAttention) as calls:
        model(input_ids=tokens, labels=tokens).loss.backward()
    assert len(calls) == TINY.num_hidden_layers and set(calls.values()) == {2}  # one forward + one recompute
