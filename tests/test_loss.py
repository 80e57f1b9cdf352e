"""loss.py: the chunked loss is the plain loss (fp32, 1e-6 relative, loss and every gradient), holds
one chunk's logits instead of all, and adds no FSDP collective (tests/test_parallelisms.py runs it
under FSDP, TP with and without loss parallel, and FSDP x TP)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from config import Compile
from loss import Loss, build_loss_fn, chunk_tokens_for, chunked_sums, summed_losses
from models.llama3 import Transformer
from tests.instruments import LiveBytes
from tests.parity_worker import TINY, build_tiny, random_batch


def _loss_and_grads(
    model: Transformer, tokens: torch.Tensor, chunk_tokens: int
) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss_fn = build_loss_fn(Compile(), chunk_tokens=chunk_tokens)
    labels = tokens[:, 1:]
    loss = model(tokens[:, :-1], head=lambda h: loss_fn(model, h, labels)).total
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _plain(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss as torchtitan writes it: fp32 cross-entropy summed and divided by the label positions."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum") / labels.numel()


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("tied", [False, True], ids=["output", "tied"])
def test_chunked_loss_is_the_plain_loss(tied: bool) -> None:
    """4 rows x 32 tokens in chunks of 1, 16, 48 (uneven last chunk) and 128 (one chunk = the plain path); the
    plain path is the plain formula to the bit."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(TINY, tie_word_embeddings=tied))
    model.init_weights()
    tokens = random_batch()
    loss, grads = _loss_and_grads(model, tokens, chunk_tokens=0)
    assert loss == _plain(model(tokens[:, :-1]), tokens[:, 1:]).item()
    for chunk in (1, 16, 48, 128):
        chunked, chunked_grads = _loss_and_grads(model, tokens, chunk_tokens=chunk)
        assert chunked == pytest.approx(loss, rel=1e-6), chunk
        assert chunked_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert _max_rel(chunked_grads[name], grad) <= 1e-6, (chunk, name)


def test_chunked_loss_holds_one_chunk_of_logits() -> None:
    """Peak bytes the loss's forward + backward hold: whole logits vs one 512-token chunk of 4096."""
    torch.manual_seed(0)
    tokens, dim, vocab = 4096, 64, 4096
    project = torch.nn.Linear(dim, vocab, bias=False)
    h = torch.randn(1, tokens, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    peaks = {}
    for chunk in (0, 512):
        with LiveBytes().track() as live:
            loss = chunked_sums(project, h, labels, chunk_tokens=chunk)[0] / labels.numel()
            loss.backward()
        peaks[chunk] = live.peak
    logits = tokens * vocab * 4  # fp32 here: the logits and their log-softmax are the same size
    # Whole: logits + log-softmax kept, then backward's gradient of each: at least 3 logits' worth.
    assert peaks[0] >= 3 * logits
    # Chunked: the same pattern on 1/8 of the tokens, plus h-sized gradients.
    assert peaks[512] <= 3 * logits / 8 + 4 * tokens * dim * 4
    assert peaks[0] / peaks[512] > 5


@pytest.mark.parametrize("chunk_tokens", [0, 16])
@pytest.mark.parametrize("z_loss_weight", [0.0, 0.1])
def test_compiled_loss_component(z_loss_weight: float, chunk_tokens: int) -> None:
    model = build_tiny()
    tokens = random_batch()
    compiled = build_loss_fn(
        Compile(enable=True, components=["loss"], backend="eager"),
        chunk_tokens=chunk_tokens,
        z_loss_weight=z_loss_weight,
    )
    plain = build_loss_fn(Compile(), chunk_tokens=chunk_tokens, z_loss_weight=z_loss_weight)
    labels = tokens[:, 1:]
    a = model(tokens[:, :-1], head=lambda h: compiled(model, h, labels))
    b = model(tokens[:, :-1], head=lambda h: plain(model, h, labels))
    assert torch.equal(a.total, b.total)


@pytest.mark.parametrize("chunk_tokens", [0, 16, 48, 128])
def test_z_loss_is_the_plain_formula_and_is_reported_on_its_own(chunk_tokens: int) -> None:
    """training.z_loss_weight: cross-entropy + weight x mean(logsumexp(logits)^2), written out plainly on the
    whole logits, against the chunked loss (chunks of 16, 48 with an uneven last one, 128 = all): loss and
    every gradient 1e-6 relative; the z-loss itself reported unweighted; validation's loss without it."""
    weight = 0.1
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights()
    tokens = random_batch()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs).float()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    (ce + weight * z).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    loss_fn = build_loss_fn(Compile(), chunk_tokens=chunk_tokens, z_loss_weight=weight)
    terms = model(inputs, head=lambda h: loss_fn(model, h, labels))
    terms.total.backward()
    assert terms.total.item() == pytest.approx((ce + weight * z).item(), rel=1e-6)
    assert z.item() > 20  # about log(128)^2 here: the weight really moves the loss
    for name, grad in expected.items():
        assert _max_rel(model.get_parameter(name).grad, grad) <= 1e-6, name
    # The terms apart: the cross-entropy (what a run logs as its loss) and the z-loss unweighted, both detached.
    assert terms.cross_entropy.item() == pytest.approx(ce.item(), rel=1e-6) and not terms.cross_entropy.requires_grad
    assert set(terms.extras) == set(loss_fn.extras) == {"z_loss"}
    assert terms.extras["z_loss"].item() == pytest.approx(z.item(), rel=1e-6)
    scored = model(inputs, head=lambda h: loss_fn.cross_entropy_only()(model, h, labels))
    assert scored.total.item() == pytest.approx(ce.item(), rel=1e-6) and scored.extras == {}


def test_by_default_only_large_logits_are_chunked() -> None:
    """training.loss_chunk_tokens = -1 (the default): chunks of 2,048 tokens only where a micro-batch's fp32 logits on
    a rank exceed 256 MiB (loss.py); a number chunks wherever the micro-batch has more tokens; 0 never."""
    # torchtitan's debug model on one GPU (local batch 8 x 2048, vocabulary 2048): 128 MiB, whole.
    assert chunk_tokens_for(-1, tokens=8 * 2048, vocab=2048) == 0
    # Llama 3's vocabulary: 2 x 8192 tokens (7.8 GiB) in chunks; 2 x 256 tokens (250 MiB) whole; under loss
    # parallel over 8 ranks each holds an eighth: 2 x 8192 tokens are 0.98 GiB a rank, still chunked.
    assert chunk_tokens_for(-1, tokens=2 * 8192, vocab=128256) == 2048
    assert chunk_tokens_for(-1, tokens=2 * 256, vocab=128256) == 0
    assert chunk_tokens_for(-1, tokens=2 * 8192, vocab=128256 // 8) == 2048
    assert chunk_tokens_for(16, tokens=128, vocab=32) == 16 and chunk_tokens_for(128, tokens=128, vocab=32) == 0
    assert chunk_tokens_for(0, tokens=2 * 8192, vocab=128256) == 0

    calls = []

    def summed(logits: torch.Tensor, labels: torch.Tensor, *, z: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls.append(logits.shape)
        return summed_losses(logits, labels, z=z)

    model, tokens = build_tiny(), random_batch()
    Loss(-1, summed=summed)(model, torch.randn(*tokens[:, 1:].shape, TINY.dim), tokens[:, 1:])
    assert calls == [(*tokens[:, 1:].shape, TINY.vocab_size)]  # the tiny model's logits: one call, whole
