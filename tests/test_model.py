"""Model shapes, parameter counts, FLOPs formula, init, statelessness."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from models import with_seq_len
from models.llama3 import FLAVORS, Transformer, num_flops_per_token, num_params
from models.llama3.model import rope_inv_freq

# Published sizes: Llama 3.2 1B/3B model cards and Llama 3.1 8B/70B/405B (HF configs).
PUBLISHED = {
    "llama3_1b": dict(params=1_235_814_400, hidden=8192, dim=2048, layers=16, heads=32, kv=8, tied=True),
    "llama3_3b": dict(params=3_212_749_824, hidden=8192, dim=3072, layers=28, heads=24, kv=8, tied=True),
    "llama3_8b": dict(params=8_030_261_248, hidden=14336, dim=4096, layers=32, heads=32, kv=8, tied=False),
    "llama3_70b": dict(params=70_553_706_496, hidden=28672, dim=8192, layers=80, heads=64, kv=8, tied=False),
    "llama3_405b": dict(params=405_853_388_800, hidden=53248, dim=16384, layers=126, heads=128, kv=8, tied=False),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_shapes_and_parameter_counts(flavor: str) -> None:
    args, ref = FLAVORS[flavor], PUBLISHED[flavor]
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads) == (
        ref["dim"],
        ref["layers"],
        ref["heads"],
        ref["kv"],
    )
    assert args.hidden_dim == ref["hidden"]
    assert args.vocab_size == 128256 and args.rope_theta == 500000.0
    assert args.tie_word_embeddings == ref["tied"]
    assert args.rope_scaling is not None
    with torch.device("meta"):  # 405B on the meta device costs nothing
        model = Transformer(with_seq_len(args, 16))
    assert sum(p.numel() for p in model.parameters()) == ref["params"] == num_params(args)
    assert list(model.layers.keys()) == [str(i) for i in range(args.n_layers)]


def test_debugmodel_parameter_count_matches_module() -> None:
    with torch.device("meta"):
        model = Transformer(with_seq_len(FLAVORS["debugmodel"], 16))
    assert sum(p.numel() for p in model.parameters()) == num_params(FLAVORS["debugmodel"])


def tiny(**changes) -> Transformer:
    args = dataclasses.replace(FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    return Transformer(with_seq_len(dataclasses.replace(args, **changes), 32))


@pytest.mark.parametrize("tied", [False, True])
def test_flops_formula_matches_counted_flops(tied: bool) -> None:
    """6N + 12 * layers * heads * head_dim * seq_len equals what FlopCounterMode counts."""
    torch.manual_seed(0)
    model = tiny(tie_word_embeddings=tied)
    model.init_weights()
    bs, seq = 2, 32
    tokens = torch.randint(0, 128, (bs, seq))
    # The math SDPA backend runs attention as counted matmuls (the fused CPU kernel is not
    # counted by FlopCounterMode) and, like the formula, computes the masked half too.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
    counted = counter.get_total_flops() / (bs * seq)
    assert counted == pytest.approx(num_flops_per_token(model.args, seq), rel=1e-9)


def test_meta_init_then_to_empty_then_init_weights() -> None:
    with torch.device("meta"):
        model = tiny()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert model.layers["0"].attention_norm.weight.eq(1).all()
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    # Deeper layers start with smaller output projections.
    assert model.layers["1"].attention.wo.weight.std() < model.layers["0"].attention.wo.weight.std()
    # Same seed, same weights.
    other = tiny()
    torch.manual_seed(0)
    other.init_weights()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))


def test_forward_is_stateless() -> None:
    """No KV cache or other state: the state dict is parameters only, and reruns are identical."""
    torch.manual_seed(0)
    model = tiny()
    model.init_weights()
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()}
    tokens = torch.randint(0, 128, (2, 32))
    first = model(tokens)
    assert first.shape == (2, 32, 128)
    assert torch.equal(first, model(tokens))
    # Causal: a token's logits do not depend on later tokens.
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 128
    assert torch.allclose(model(changed)[:, :20], first[:, :20], atol=1e-6)


def test_tied_model_uses_the_embedding_as_output() -> None:
    torch.manual_seed(0)
    model = tiny(tie_word_embeddings=True)
    model.init_weights()
    assert model.output is None
    tokens = torch.randint(0, 128, (1, 8))
    loss = model(tokens).sum()
    loss.backward()
    assert model.tok_embeddings.weight.grad is not None


@pytest.mark.parametrize("name", ["llama3", "qwen3", "olmo2"])
@pytest.mark.parametrize("tied", [False, True])
def test_the_first_loss_is_about_ln_vocab_tied_or_not(name: str, tied: bool) -> None:
    """Logits start at unit scale in every family, also when the output projection is the embedding (Llama 3.2
    1B, Qwen3 0.6B-4B): the embedding's std 1, kept as the output projection, gave llama3_1b a first loss of 1,777
    on a GPU."""
    import models

    args = dataclasses.replace(models.family(name).flavors["debugmodel"], dim=512, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = models.family(name).model_cls(with_seq_len(args, 64))
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 65))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    # Within a nat: a tied output projection still meets the input token's own embedding in the last hidden state
    # (measured: 7.6-7.7 untied, 8.4-8.6 tied; llama3_1b tied 12.26 against ln(128256) = 11.76, 1,703 before).
    assert loss.item() == pytest.approx(math.log(args.vocab_size), abs=1.0), loss


def test_rope_llama3_scaling_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = FLAVORS["llama3_8b"]
    scaling = args.rope_scaling
    config = LlamaConfig(
        hidden_size=args.dim,
        num_attention_heads=args.n_heads,
        rope_theta=args.rope_theta,
        rope_scaling={
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
    )
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inv_freq(args.head_dim, args.rope_theta, scaling)
    torch.testing.assert_close(ours, hf_inv_freq.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("dtype", "kernels"), [(torch.float32, (3, 4)), (torch.bfloat16, (5, 5))])
def test_rope_gives_attention_what_hugging_faces_rotate_half_gives_in_few_kernels(
    dtype: torch.dtype, kernels: tuple[int, int]
) -> None:
    """models/rope.py returns q and k permuted alike within each head: their dot products, all attention
    reads of them, and the gradients of the projections equal those of transformers' rotate-half. q and k
    together: forward launches three kernels in float32 (one copy of both, a complex multiply each) and five in
    bfloat16 (one multiply, the casts), backward four and five (a copy back for each), where rotate-half written
    out takes eight and twelve forward, eight and fourteen backward. q and k own their storages."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from models.llama3.model import rope_cos_sin
    from models.rope import apply_rope
    from planning.trace import observe_ops

    args = dataclasses.replace(FLAVORS["debugmodel"], max_seq_len=32)
    table = rope_cos_sin(args)
    angles = torch.outer(torch.arange(16.0), rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling))
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)  # HF's tables
    torch.manual_seed(0)
    q = torch.randn(2, 16, args.n_heads, args.head_dim, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 16, args.kv_heads, args.head_dim, dtype=dtype, requires_grad=True)
    forward: list[str] = []
    backward: list[str] = []
    with observe_ops(lambda op, *_: op.is_view or forward.append(op.name())):
        q_rot, k_rot = apply_rope(q, k, table)
    grads = torch.ones_like(q_rot), torch.ones_like(k_rot)
    with observe_ops(lambda op, *_: op.is_view or backward.append(op.name())):
        torch.autograd.backward((q_rot, k_rot), grads)
    assert (len(forward), len(backward)) == kernels, (forward, backward)
    assert q_rot.untyped_storage().data_ptr() != k_rot.untyped_storage().data_ptr()
    q.grad = k.grad = None

    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # q . k of every head pair attention forms
        return torch.einsum("bshd,btgd->bhgst", q.double(), k.double())

    ours = scores(*apply_rope(q, k, table))
    q_ref, k_ref = (t.detach().double().requires_grad_() for t in (q, k))
    hf_q, hf_k = apply_rotary_pos_emb(q_ref, k_ref, cos.double(), sin.double(), unsqueeze_dim=1)
    theirs = scores(hf_q, hf_k)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance * theirs.abs().max().item())
    weights = torch.randn_like(theirs)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    for mine, ref in ((q.grad, q_ref.grad), (k.grad, k_ref.grad)):
        torch.testing.assert_close(mine.double(), ref, rtol=tolerance, atol=tolerance * ref.abs().max().item())


def test_compiled_rope_is_the_eager_rotation_in_one_fused_kernel_each_way() -> None:
    """Under torch.compile models/rope.py rotates in real arithmetic: the same values and gradients as the
    eager complex form (a KV cache filled by an eager prefill is read by a compiled decode), and inductor
    fuses it, casts included, into one kernel forward and one backward beside the projection's matmul."""
    from torch._inductor.utils import run_and_get_code

    from models.llama3.model import rope_cos_sin
    from models.rope import apply_rope

    args = dataclasses.replace(FLAVORS["debugmodel"], max_seq_len=32)
    table = rope_cos_sin(args)
    torch.manual_seed(0)
    x = torch.randn(2, 16, args.dim, dtype=torch.bfloat16)
    wq = torch.randn(args.n_heads * args.head_dim, args.dim, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 16, args.n_heads, args.head_dim, dtype=torch.bfloat16)

    def q_rotated(x: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
        q = F.linear(x, wq).view(2, 16, args.n_heads, args.head_dim)
        return apply_rope(q, q, table)[0]

    eager = q_rotated(x, wq)
    eager.backward(grad)
    eager_grad, wq.grad = wq.grad, None

    def step() -> torch.Tensor:
        out = torch.compile(q_rotated, fullgraph=True)(x, wq)
        out.backward(grad)
        return out

    compiled, (forward, backward) = run_and_get_code(step)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0.02)
    torch.testing.assert_close(wq.grad, eager_grad, rtol=0.02, atol=0.02 * eager_grad.abs().max().item())
    for code in (forward, backward):
        launches = re.findall(
            r"^\s+(cpp_fused_\w+|extern_kernels\.\w+|aten\.\w+)\(", code[code.index("def call(") :], re.M
        )
        assert sorted(launch.startswith("cpp_fused_") for launch in launches) == [False, True], launches


def test_block_causal_logits_of_a_packed_window_are_those_of_each_document_alone() -> None:
    """RoPE depends on relative positions only, so a document attending to itself alone computes
    what it computes alone, wherever it sits in the window."""
    args = with_seq_len(dataclasses.replace(FLAVORS["debugmodel"], attn_mask_type="block_causal"), 96)
    torch.manual_seed(0)
    model = Transformer(args).float()
    model.init_weights()
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, args.vocab_size, (n,), generator=generator) for n in (37, 20, 39)]
    tokens = torch.cat(docs)[None]  # (1, 96)
    segments = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = model(tokens, segments=segments)
        causal = model(tokens)  # no segments: causal over the whole window
        offset, worst = 0, 0.0
        for doc in docs:
            alone = model(doc[None])
            worst = max(worst, (alone[0] - packed[0, offset : offset + len(doc)]).abs().max().item())
            offset += len(doc)
    assert worst < 1e-5, worst
    # The first document sees nothing else either way; the later ones see the earlier ones under causal.
    assert torch.allclose(causal[0, :37], packed[0, :37], atol=1e-5)
    assert (causal[0, 37:] - packed[0, 37:]).abs().max().item() > 0.1
