"""Compressors and feedback wrappers for pipeline boundaries."""

from __future__ import annotations

import math

import pytest
import torch

from qsync_opt.core.errors import QsyncInputError
from qsync_opt.strategy.codecs import (
    AQSGD,
    EF,
    EF21,
    Identity,
    Plain,
    Quant,
    TopK,
    aqsgd_bytes,
    make_codec,
    parse_compressor,
)
from qsync_opt.strategy.compressor_text import parse_compressor_text

SHAPES = [(1,), (7,), (3, 5), (4, 8, 8), (2, 300), (70_000,)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("frac", [1.0, 0.3, 0.1, 0.05, 0.01, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_topk_keeps_exactly_ceil_k_n_largest(shape, frac, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype)
    c = TopK(frac)
    p = c.compress(x)
    y = c.decompress(p)
    n = x.numel()
    k = math.ceil(frac * n)
    kept = y.reshape(-1) != 0
    assert int(kept.sum()) == k  # randn has no zeros, so every kept value is nonzero
    assert torch.equal(y.reshape(-1)[kept], x.reshape(-1)[kept])  # values exact
    # the kept magnitudes are the k largest: every kept one >= every dropped one
    mags = x.reshape(-1).abs().float()
    if k < n:
        assert float(mags[kept].min()) >= float(mags[~kept].max())
    # wire bytes: the formula, and what the payload really holds
    width = 1 if n <= 256 else 2 if n <= 65536 else 4
    formula = k * x.element_size() + min(k * width, math.ceil(n / 8))
    assert p.nbytes == formula == c.wire_bytes(n, x.element_size())
    assert p.form == ("bitmap" if math.ceil(n / 8) < k * width else "indices")


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", SHAPES)
def test_quantization_error_within_half_a_step_and_wire_bytes(bits, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(bits)) * 3 + 1
    c = Quant(bits)
    p = c.compress(x)
    y = c.decompress(p)
    lo, hi = float(x.min()), float(x.max())
    step = (hi - lo) / ((1 << bits) - 1)
    assert float((y - x).abs().max()) <= step / 2 * (1 + 1e-5) + 1e-6
    assert p.nbytes == math.ceil(x.numel() * bits / 8) + 8 == c.wire_bytes(x.numel(), 4)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_stochastic_rounding_is_unbiased_and_within_a_step():
    x = torch.rand(20_000, generator=torch.Generator().manual_seed(1))
    c = Quant(2, stochastic=True, seed=3)
    step = (float(x.max()) - float(x.min())) / 3
    ys = torch.stack([c.decompress(c.compress(x)) for _ in range(200)])
    assert float((ys - x).abs().max()) <= step * (1 + 1e-5)
    assert float((ys.mean(0) - x).abs().mean()) < step * 0.05  # round to nearest: ~step/4


def test_constant_and_empty_tensors_quantize_exactly():
    for c in (Quant(4), TopK(0.1), Identity()):
        x = torch.full((5, 3), 2.5)
        if not isinstance(c, TopK):
            assert torch.equal(c.decompress(c.compress(x)), x)
        e = torch.zeros(0)
        assert c.decompress(c.compress(e)).numel() == 0


def test_identity_is_bit_for_bit():
    x = torch.randn(4, 9, dtype=torch.float64)
    c = Identity()
    assert c.decompress(c.compress(x)) is x
    assert c.wire_bytes(36, 8) == 288


def test_error_feedback_sums_what_was_sent_to_the_inputs_minus_the_error():
    gen = torch.Generator().manual_seed(0)
    send, recv = EF(TopK(0.1)), EF(TopK(0.1))
    inputs = [torch.randn(50, 8, generator=gen, dtype=torch.float64) for _ in range(30)]
    sent = [recv.decode(send.encode(x)) for x in inputs]
    err = send.error["0:50x8"]
    assert torch.allclose(sum(sent), sum(inputs) - err, atol=1e-12)
    # slots keep separate buffers
    send.encode(inputs[0], slot=1)
    assert set(send.error) == {"0:50x8", "1:50x8"}


def test_ef21_receiver_mirrors_the_sender_and_converges_on_a_fixed_input():
    send, recv = EF21(TopK(0.2)), EF21(TopK(0.2))
    x = torch.randn(40, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for _ in range(60):
        out = recv.decode(send.encode(x))
        assert torch.equal(out, send.g["0:40"])
    assert float((out - x).abs().max()) < 1e-9


def test_aqsgd_on_a_repeated_sample_drives_the_message_to_zero():
    gen = torch.Generator().manual_seed(4)
    n = 10
    send, recv = AQSGD(TopK(0.1), n), AQSGD(TopK(0.1), n)
    idx = torch.tensor([3, 7])
    first = torch.randn(2, 16, 4, generator=gen)
    p0 = send.encode(first, idx)
    assert torch.equal(recv.decode(p0, idx), first)  # first visit: the sample whole
    assert p0.nbytes == first.numel() * 4 + TopK(0.1).wire_bytes(0, 4)
    x = first + torch.randn(2, 16, 4, generator=gen)  # the sample's activation has moved
    norms = []
    for _ in range(80):
        p = send.encode(x, idx)
        out = recv.decode(p, idx)
        norms.append(float(p.tensors[1].abs().max()))  # the message's values
    assert norms[-1] < 1e-6 * norms[0]
    assert torch.allclose(out, x, atol=1e-6)
    assert torch.equal(send.buf, recv.buf)  # both sides hold the same buffers
    assert aqsgd_bytes(n, 64) == 2 * n * 64 * 4


def test_aqsgd_refuses_what_it_cannot_key():
    c = AQSGD(Identity(), 4)
    with pytest.raises(QsyncInputError, match="index"):
        c.encode(torch.zeros(2, 3))
    with pytest.raises(QsyncInputError, match="twice"):
        c.encode(torch.zeros(2, 3), torch.tensor([1, 1]))
    with pytest.raises(QsyncInputError, match="outside"):
        c.encode(torch.zeros(2, 3), torch.tensor([1, 4]))
    with pytest.raises(QsyncInputError, match="samples"):
        make_codec(Identity(), "aqsgd")


def test_codec_state_round_trips():
    a = make_codec(Quant(3, stochastic=True, seed=1), "ef")
    x = torch.randn(30)
    a.encode(x)
    b = make_codec(Quant(3, stochastic=True, seed=9), "ef")
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.encode(x).tensors[0], b.encode(x).tensors[0])


@pytest.mark.parametrize(("text", "kind"), [("none", Identity), ("topk:0.1", TopK),
                                            ("topk:10%", TopK), ("quant:4", Quant),
                                            ("quant:2,stochastic", Quant)])
def test_parse_compressor(text, kind):
    assert isinstance(parse_compressor(text), kind)


@pytest.mark.parametrize("text", ["topk:0", "topk:1.5", "topk:x", "quant:9", "quant:0",
                                  "quant:4,foo", "gzip"])
def test_parse_compressor_refuses_by_name(text):
    with pytest.raises(QsyncInputError, match="topk|quant|compressor"):
        parse_compressor(text)


def test_make_codec_names_the_feedbacks():
    assert isinstance(make_codec(Identity(), "none"), Plain)
    with pytest.raises(QsyncInputError, match="feedback"):
        make_codec(Identity(), "ef3")


@pytest.mark.parametrize("text", [
    "none", "identity", " NONE ", "topk:0.1", "topk:10%", "topk:1", "topk:100%", "quant:1",
    "quant:8", "quant:2,stochastic", "QUANT:4", "topk:0", "topk:1.5", "topk:x", "topk:",
    "topk:nan", "topk:inf", "topk:-0.5", "topk:101%", "topk:٣", "quant:9", "quant:0",
    "quant:4,foo", "quant:", "quant:²", "quant:4,", "gzip", "", ":", "topk", "quant"])
def test_the_text_check_and_the_compressor_agree(text):
    """The torch-free check (the flags', the run config's) accepts exactly the texts the
    compressor is built from, and refuses the others with the same one line."""
    try:
        built = parse_compressor(text)
    except QsyncInputError as exc:
        with pytest.raises(QsyncInputError) as got:
            parse_compressor_text(text)
        assert str(got.value) == str(exc)
        return
    spec = parse_compressor_text(text)
    assert {"identity": Identity, "topk": TopK, "quant": Quant}[spec.kind] is type(built)
    if spec.kind == "topk":
        assert (spec.frac, f"topk:{spec.frac:g}") == (built.frac, built.name)
    if spec.kind == "quant":
        assert (spec.bits, spec.stochastic) == (built.bits, built.stochastic)
