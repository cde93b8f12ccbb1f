"""The workload registry (qsync_opt.models): builders on meta, inputs, the real data sets."""

from __future__ import annotations

import builtins
import math
import string

import pytest
import torch
from qsync_opt.models import compute_loss, get_workload, list_workloads
from qsync_opt.models import digits_cnn as digits_mod
from qsync_opt.models import tiny_gpt as tiny_mod

from qsync_opt import models

META = torch.device("meta")
CPU = torch.device("cpu")

ALL = ["bert_base", "digits_cnn", "digits_resnet", "gpt2_medium", "gpt2_small", "gpt2_xl", "resnet18",
       "resnet18_32", "resnet50", "tiny_gpt", "vgg16_bn", "vit_b16"]

# Published parameter counts (torchvision / HuggingFace layouts); the small ones by hand:
# digits_cnn = conv1 1*32*9 + bn1 2*32 + conv2 32*64*9 + bn2 2*64 + fc1 1024*128+128
#              + fc2 128*10+10 = 288 + 64 + 18432 + 128 + 131200 + 1290 = 151,402.
# digits_resnet = stem conv 1*16*9 + bn 2*16 = 176
#               + layer1: 2 convs 16*16*9 + 2 bn 2*16 = 4608 + 64 = 4,672
#               + layer2: conv 16*32*9 + conv 32*32*9 + 1x1 16*32 + 3 bn 2*32
#                 = 4608 + 9216 + 512 + 192 = 14,528
#               + layer3: conv 32*64*9 + conv 64*64*9 + 1x1 32*64 + 3 bn 2*64
#                 = 18432 + 36864 + 2048 + 384 = 57,728
#               + fc 64*10+10 = 650;  176 + 4672 + 14528 + 57728 + 650 = 77,754.
# tiny_gpt   = wte 98*128 + wpe 128*128 + 4 * (2 LN 512 + qkv 128*384+384 + proj 128*128+128
#              + fc 128*512+512 + proj 512*128+128) + ln_f 256
#            = 12544 + 16384 + 4 * 198272 + 256 = 822,272 (lm_head tied to wte).
# resnet18_32 = resnet18 - 7x7 stem 3*64*49 + 3x3 stem 3*64*9 - fc 512*1000+1000 + 512*10+10
#             = 11,689,512 - 9,408 + 1,728 - 513,000 + 5,130 = 11,173,962.
PARAMS = {
    "resnet18": 11_689_512,
    "resnet18_32": 11_173_962,
    "resnet50": 25_557_032,
    "vgg16_bn": 138_365_992,
    "bert_base": 108_893_186,
    "gpt2_small": 124_439_808,
    "gpt2_medium": 354_823_168,
    "gpt2_xl": 1_557_611_200,
    "vit_b16": 86_567_656,
    "digits_cnn": 151_402,
    "digits_resnet": 77_754,
    "tiny_gpt": 822_272,
}

# (input shapes and dtypes, target shape) at batch 2, from each workload's input_doc.
SHAPES_B2 = {
    "resnet18": ([((2, 3, 224, 224), torch.float32)], (2,)),
    "resnet18_32": ([((2, 3, 32, 32), torch.float32)], (2,)),
    "resnet50": ([((2, 3, 224, 224), torch.float32)], (2,)),
    "vgg16_bn": ([((2, 3, 224, 224), torch.float32)], (2,)),
    "vit_b16": ([((2, 3, 224, 224), torch.float32)], (2,)),
    "bert_base": ([((2, 384), torch.int64), ((2, 384), torch.int64)], (2, 2)),
    "gpt2_small": ([((2, 1024), torch.int64)], (2, 1024)),
    "gpt2_medium": ([((2, 1024), torch.int64)], (2, 1024)),
    "gpt2_xl": ([((2, 1024), torch.int64)], (2, 1024)),
    "digits_cnn": ([((2, 1, 8, 8), torch.float32)], (2,)),
    "digits_resnet": ([((2, 1, 32, 32), torch.float32)], (2,)),
    "tiny_gpt": ([((2, 128), torch.int64)], (2, 128)),
}


def test_registry_names() -> None:
    assert list_workloads() == ALL
    assert set(models.WORKLOADS) == set(ALL)
    for name in ALL:
        assert get_workload(name).name == name


def test_lookup_normalises_case_and_dashes() -> None:
    assert get_workload("GPT2-Small") is get_workload("gpt2_small")
    assert get_workload(" resnet18 ") is get_workload("resnet18")


@pytest.mark.parametrize("bad", ["resnet5", "gpt3", ""])
def test_unknown_workload_lists_known_names(bad: str) -> None:
    with pytest.raises(models.UnknownWorkloadError) as exc:
        get_workload(bad)
    assert str(exc.value) == f"unknown model {bad!r}; known: {', '.join(ALL)}"
    assert isinstance(exc.value, KeyError) and isinstance(exc.value, ValueError)


@pytest.mark.parametrize("name", ALL)
def test_builds_on_meta_with_published_param_count(name: str) -> None:
    wl = get_workload(name)
    with torch.device("meta"):
        model = wl.build()
    params = list(model.parameters())
    assert params
    assert all(p.device.type == "meta" for p in params)
    assert all(b.device.type == "meta" for b in model.buffers())
    # parameters() deduplicates shared tensors, so a tied lm_head is counted once.
    assert sum(p.numel() for p in params) == PARAMS[name]


@pytest.mark.parametrize("name", ["gpt2_small", "tiny_gpt"])
def test_lm_head_is_tied_to_the_token_embedding(name: str) -> None:
    with torch.device("meta"):
        model = get_workload(name).build()
    assert model.lm_head.weight is model.transformer.wte.weight
    all_with_dupes = sum(
        p.numel() for _, p in model.named_parameters(remove_duplicate=False)
    )
    vocab = 50257 if name == "gpt2_small" else 98
    width = 768 if name == "gpt2_small" else 128
    assert all_with_dupes - PARAMS[name] == vocab * width


@pytest.mark.parametrize("name", ALL)
def test_meta_inputs_have_the_documented_shapes(name: str) -> None:
    wl = get_workload(name)
    inputs = wl.make_inputs(2, META)
    targets = wl.make_targets(2, META)
    want_inputs, want_target = SHAPES_B2[name]
    assert [(tuple(t.shape), t.dtype) for t in inputs] == want_inputs
    assert all(t.device.type == "meta" for t in inputs)
    assert tuple(targets.shape) == want_target
    assert targets.dtype == torch.int64
    assert targets.device.type == "meta"
    assert wl.loss == "cross_entropy"
    assert wl.default_batch >= 1


@pytest.mark.parametrize(("name", "seq"), [("bert_base", 384), ("gpt2_small", 1024),
                                           ("tiny_gpt", 128), ("resnet18", None)])
def test_seq_len_field(name: str, seq: int | None) -> None:
    assert get_workload(name).seq_len == seq


def test_real_data_flags() -> None:
    assert {n for n in ALL if get_workload(n).real_data} == {"digits_cnn", "digits_resnet",
                                                                "tiny_gpt"}


def test_cpu_inputs_are_seeded_and_in_range() -> None:
    wl = get_workload("bert_base")
    ids, types = wl.make_inputs(3, CPU)
    ids2, _ = wl.make_inputs(3, CPU)
    assert torch.equal(ids, ids2)
    assert int(ids.min()) >= 0 and int(ids.max()) < 30522
    # Segment A is the first quarter (96 of 384 tokens), segment B the rest.
    assert int(types[:, :96].sum()) == 0
    assert int(types[:, 96:].min()) == 1
    start_end = wl.make_targets(3, CPU)
    assert bool((start_end[:, 0] <= start_end[:, 1]).all())


def test_digits_data() -> None:
    x, y = models.load_digits_tensors()
    assert tuple(x.shape) == (1797, 1, 8, 8)
    assert x.dtype == torch.float32
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert tuple(y.shape) == (1797,)
    assert y.dtype == torch.int64
    assert sorted(y.unique().tolist()) == list(range(10))
    assert digits_mod.NUM_CLASSES == 10
    xtr, ytr, xte, yte = models.train_test_split(x, y, test_fraction=0.2, seed=0)
    assert (xtr.shape[0], xte.shape[0]) == (1797 - 359, 359)  # round(1797 * 0.2) = 359
    assert ytr.shape[0] + yte.shape[0] == 1797
    again = models.train_test_split(x, y, test_fraction=0.2, seed=0)
    assert torch.equal(again[3], yte)


def test_the_digits_are_scikit_learns_read_without_importing_it(monkeypatch) -> None:
    """The digits come from scikit-learn's bundled file, the same arrays as
    ``sklearn.datasets.load_digits`` gives, with scikit-learn never imported (its import
    cost every training rank a second); where the file is missing, through scikit-learn."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    want_x = torch.as_tensor(bunch.images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    want_y = torch.as_tensor(bunch.target, dtype=torch.int64)
    real_import = builtins.__import__

    def no_sklearn(name, *args, **kwargs):
        if name.split(".")[0] == "sklearn":
            raise AssertionError(f"imported {name}")
        return real_import(name, *args, **kwargs)

    with monkeypatch.context() as m:  # an import of scikit-learn now fails the test
        m.setattr(builtins, "__import__", no_sklearn)
        x, y = models.load_digits_tensors()
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    monkeypatch.setattr(digits_mod, "_digits_csv", lambda: None)  # no file: scikit-learn's
    x, y = models.load_digits_tensors()
    assert torch.equal(x, want_x) and torch.equal(y, want_y)


def test_stdlib_corpus_and_char_vocabulary() -> None:
    corpus = tiny_mod.stdlib_corpus(max_chars=20_000)
    assert len(corpus) == 20_000
    assert "def " in corpus
    assert tiny_mod.VOCAB_SIZE == len(tiny_mod.VOCAB) == 98
    printable = "".join(chr(c) for c in range(32, 127)) + "\t\n"
    ids = tiny_mod.encode(printable)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [*range(3, 98), 1, 2]
    assert tiny_mod.decode(ids) == printable
    sample = corpus[:2000]
    if all(ch in printable for ch in sample):
        assert tiny_mod.decode(tiny_mod.encode(sample)) == sample
    # Anything else (carriage return, non-ASCII) is <unk> = 0 and decodes to U+FFFD.
    assert tiny_mod.encode("\ré").tolist() == [0, 0]
    assert tiny_mod.decode([0, 36]) == "\ufffdA"
    assert set(string.ascii_letters) <= set(tiny_mod.VOCAB)


def test_char_batches_are_shifted_by_one() -> None:
    data = tiny_mod.encode(tiny_mod.stdlib_corpus(max_chars=5_000))
    gen = torch.Generator().manual_seed(0)
    x, y = tiny_mod.sample_batch(data, batch_size=4, block_size=16, generator=gen)
    assert tuple(x.shape) == tuple(y.shape) == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize(("name", "classes", "out_shape"),
                         [("digits_cnn", 10, (4, 10)), ("digits_resnet", 10, (4, 10)),
                          ("tiny_gpt", 98, (4, 128, 98))])
def test_real_forward_backward_on_cpu(name: str, classes: int, out_shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    wl = get_workload(name)
    model = wl.build()
    inputs = wl.make_inputs(4, CPU)
    targets = wl.make_targets(4, CPU)
    out = model(*inputs)
    assert tuple(out.shape) == out_shape
    loss = compute_loss(wl, out, targets)
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    # At init the logits are near uniform, so cross-entropy is near ln(classes):
    # ln 10 = 2.303, ln 98 = 4.585. Tolerance 0.5 nats (measured: 2.29 and 4.61 at seed 0).
    assert abs(loss.item() - math.log(classes)) < 0.5
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    assert any(float(p.grad.abs().sum()) > 0 for p in model.parameters())


def test_digits_real_batch_loss_near_ln10() -> None:
    torch.manual_seed(0)
    x, y = models.load_digits_tensors()
    model = get_workload("digits_cnn").build()
    loss = compute_loss("digits_cnn", model(x[:64]), y[:64])
    assert abs(loss.item() - math.log(10)) < 0.5


def test_compute_loss_by_task_matches_hand_formula() -> None:
    torch.manual_seed(0)
    # QA: output (B,S,2), targets (B,2) -> mean of start and end cross-entropies.
    logits = torch.randn(3, 5, 2)
    targets = torch.tensor([[0, 1], [2, 4], [3, 3]])
    got = compute_loss("bert_base", logits, targets)
    start = torch.nn.functional.cross_entropy(logits[..., 0], targets[:, 0])
    end = torch.nn.functional.cross_entropy(logits[..., 1], targets[:, 1])
    assert got.item() == pytest.approx(((start + end) / 2).item(), rel=1e-6)
    # Causal LM: uniform logits give exactly ln V.
    lm = compute_loss("tiny_gpt", torch.zeros(2, 4, 98), torch.zeros(2, 4, dtype=torch.int64))
    assert lm.item() == pytest.approx(math.log(98), rel=1e-6)
