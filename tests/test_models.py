"""Model layouts: torchvision's published parameter counts and plain sizes."""

from __future__ import annotations

import pytest

from netstorm.errors import PolicyError
from netstorm.models import backward_yields, layout


def test_alexnet_matches_torchvision():
    model = layout("alexnet")
    assert model.params == 61_100_840
    assert len(model.tensors) == 16
    assert model.tensors[0] == ("features.0.weight", (64, 3, 11, 11))
    assert model.tensors[-1] == ("classifier.6.bias", (1000,))
    assert model.bytes == 4 * 61_100_840


def test_resnet50_matches_torchvision():
    model = layout("ResNet50")
    assert model.params == 25_557_032
    assert len(model.tensors) == 161
    assert model.tensors[0] == ("conv1.weight", (64, 3, 7, 7))
    assert ("layer3.0.downsample.0.weight", (1024, 512, 1, 1)) in model.tensors
    assert model.tensors[-2] == ("fc.weight", (1000, 2048))


@pytest.mark.parametrize(("spec", "params"), [("15275210", 15_275_210), ("1e6", 1_000_000), ("61.1M", 61_100_000),
                                               ("2k", 2000)])
def test_plain_sizes(spec, params):
    model = layout(spec)
    assert model.params == params
    assert model.sizes == [params]


@pytest.mark.parametrize(("spec", "sizes"), [("10/3", [4, 3, 3]), ("1e6/4", [250_000] * 4), ("2k/1", [2000]),
                                              ("5/5", [1] * 5)])
def test_sizes_split_into_layers(spec, sizes):
    model = layout(spec)
    assert model.sizes == sizes
    assert [name for name, _ in model.tensors] == [f"layer{i}" for i in range(len(sizes))]


@pytest.mark.parametrize("spec", ["vgg", "0", "1.5", "-3", "", "10/0", "10/11", "10/x", "10/", "10/2.5", "/4",
                                  "alexnet/2"])
def test_bad_models_are_rejected(spec):
    with pytest.raises(PolicyError):
        layout(spec)


def test_backward_yields_the_last_layer_first_after_forward_by_size():
    # 3 s of compute: forward 1 s, backward 2 s shared 1:3:6 by size, last layer first
    yields = backward_yields([100, 300, 600], 3.0)
    assert [i for i, _ in yields] == [2, 1, 0]
    assert [t for _, t in yields] == pytest.approx([1 + 2 * 0.6, 1 + 2 * 0.9, 3.0])
    assert backward_yields([5], 0.0) == [(0, 0.0)]
