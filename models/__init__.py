"""Model families. One folder per family owns everything particular to its architecture; the rest
of the repo reaches a family through `family(name)`, a plain `match` on `[model] name`.

A family folder (models/llama3/, models/qwen3/, models/olmo2/) holds:

    model.py     ModelArgs, FLAVORS, the module, its init, num_params and num_flops_per_token
    plans.py     how tensor parallel splits one block (`tp_plan`), which linears' outputs
                 selective op-level AC keeps (`SAC_SAVED_LINEARS`, named, not counted) and which
                 weights Muon orthogonalizes (`HIDDEN_MATRICES`)
    hf.py        Hugging Face config.json <-> ModelArgs (the shared fields read by models/hf_reader.py),
                 weight names, the published repos
    __init__.py  FAMILY, a ModelFamily (models/family.py) built from those three

and nothing outside it names a module inside a block. What the generic code (train.py,
parallelisms/, checkpoint/, loss.py, planning/estimate_memory.py, planning/dry_run.py, planning/doctor.py) may rely on is
the decoder skeleton every family's model has:

    model.args                  its ModelArgs; the generic code reads dim, n_layers, n_heads,
                                kv_heads, head_dim, vocab_size, max_seq_len, tie_word_embeddings
                                and attn_mask_type, and sets max_seq_len and attn_mask_type
                                (dataclasses.replace) before building; a mixture of experts'
                                args also have `balance` (models/moe.py), which config's
                                [model.moe] sets
    model.tok_embeddings        nn.Embedding, or None on a pipeline stage without it
    model.layers                nn.ModuleDict of blocks keyed "0", "1", ... (names never depend on
                                how a pipeline cuts the model); block(h, *extra, kv=None) -> h,
                                where h is (bs, seqlen, dim), the extras are per-forward tensors
                                (the RoPE table, the attention mask) every rank holds in full, and
                                kv is generation's view of the cache for that block (LayerCache,
                                models/kv_cache.py)
    model.norm, model.output    the final norm and the output projection (None: tied to the
                                embedding, or a pipeline stage without them)
    model(tokens, segments=None, *, positions=None, head=None, cache=None)
                                logits, or head(final norm's output); positions: the window
                                positions of tokens that are a part of the window (context parallel),
                                or their cache positions; cache: generation's KV cache
                                (models/kv_cache.py), which training never passes
    block.attention.sdpa        the attention core, models/attention.py (context parallel wraps it)
    model.project(h)            the output projection (loss.py applies it chunk by chunk)
    model.init_weights(buffer_device=None)       fills meta-built parameters and buffers in place
    model.init_buffers(device)  computes the buffers derived from args (the RoPE table) alone

Adding a family: copy a folder, change it, add one arm to `family` below (docs/new_model.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from errors import ConfigError
from models.family import ModelFamily  # (its own module: the family folders import it)

NAMES = ("llama3", "qwen3", "olmo2", "qwen3_moe")  # the arms of `family`, for messages and --help


def family(name: str) -> ModelFamily:
    """The family `[model] name` names. Imported on demand: a run imports only its own family."""
    match name:
        case "llama3":
            from models.llama3 import FAMILY
        case "qwen3":
            from models.qwen3 import FAMILY
        case "olmo2":
            from models.olmo2 import FAMILY
        case "qwen3_moe":
            from models.qwen3_moe import FAMILY
        case _:
            raise ConfigError(f"model.name: unknown model family {name!r}; choose from {', '.join(NAMES)}")
    return FAMILY


def with_seq_len(args: Any, seq_len: int) -> Any:
    """The shape with a RoPE table just long enough for `seq_len` tokens."""
    return dataclasses.replace(args, max_seq_len=seq_len)


def parameter_shapes(fam: ModelFamily, args: Any) -> dict[str, torch.Size]:
    """Parameter name -> shape of a model of `args`, from a model on the meta device (costs nothing)."""
    with torch.device("meta"):
        return {name: t.shape for name, t in fam.model_cls(with_seq_len(args, 1)).state_dict().items()}
