"""Image backbones that expose their last feature map, plus the plain linear-head classifier.

Every backbone returns (B, d, h, w) from `forward_features` so FedNCA-ML can read the map as
h*w tokens, while the baselines pool it into one feature vector.
"""

from __future__ import annotations

import torch
from torch import nn
from pathlib import Path

from safetensors.torch import load_file as load_safetensors
from torchvision.models import resnet18, resnet50

BACKBONES = ("small-cnn", "resnet18", "resnet50")
SMALL_IMAGE_SIDE = 96
RESNETS = {18: (resnet18, 512), 50: (resnet50, 2048)}  # depth -> (torchvision constructor, feature dim)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # torchvision's ImageNet weights


class PretrainedWeightsError(ValueError):
    """A `pretrained` weights file is missing, unreadable or for another architecture."""


def conv_bn_relu(in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """3x3 conv layers with one stride-2 stage: fast on a CPU, keeps an (H/2 x W/2) token grid.

    With `feature_side` > 0, another stage (a stride-2 conv and a conv) follows while the map's side
    is above it, so a token's receptive field grows with the image instead of staying 11 px: on
    56 px images one token of the original grid sees a fifth of a 28 px digit."""

    def __init__(self, in_channels: int, image_size: int = 0, feature_side: int = 0, width: int = 32):
        super().__init__()
        self.feature_dim = 2 * width
        stages = [
            conv_bn_relu(in_channels, width),
            conv_bn_relu(width, width),
            conv_bn_relu(width, 2 * width, stride=2),
            conv_bn_relu(2 * width, 2 * width),
        ]
        side = (image_size + 1) // 2
        while feature_side and side > feature_side:
            stages += [conv_bn_relu(2 * width, 2 * width, stride=2), conv_bn_relu(2 * width, 2 * width)]
            side = (side + 1) // 2
        self.features = nn.Sequential(*stages)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


class ImageNetInput(nn.Module):
    """What ImageNet weights expect of their input: grey images repeated to RGB, then ImageNet mean/std."""

    def __init__(self):
        super().__init__()
        # Non-persistent: constants, not weights to average or store.
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.expand(-1, 3, -1, -1) - self.mean) / self.std


class ResNet(nn.Module):
    """A torchvision ResNet trunk; small images (< 96 px) get the CIFAR stem: 3x3 stride-1 conv, no max-pool.

    `imagenet_input=True` is the architecture of pretrained ImageNet weights: the torchvision stem at any
    image size (its 7x7 conv is part of the weights) on 3 channels, fed by ImageNetInput.
    """

    def __init__(self, depth: int, in_channels: int, small_images: bool = True, imagenet_input: bool = False):
        super().__init__()
        constructor, self.feature_dim = RESNETS[depth]
        net = constructor(weights=None)
        self.input = ImageNetInput() if imagenet_input else nn.Identity()
        if imagenet_input:
            pass  # torchvision's own stem: the pretrained weights include it
        elif small_images:
            net.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
            net.maxpool = nn.Identity()
        elif in_channels != 3:
            net.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.stages = nn.Sequential(net.layer1, net.layer2, net.layer3, net.layer4)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(self.input(x)))


# torchvision's parameter names -> ours ("conv1.weight" -> "stem.0.weight", "layer2.0..." -> "stages.1.0...").
TORCHVISION_PREFIXES = {"conv1.": "stem.0.", "bn1.": "stem.1.", **{f"layer{i}.": f"stages.{i - 1}." for i in range(1, 5)}}


def _from_torchvision_name(name: str) -> str:
    for theirs, ours in TORCHVISION_PREFIXES.items():
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def build_backbone(
    name: str, in_channels: int, image_size: int, imagenet_input: bool = False, feature_side: int = 0
) -> nn.Module:
    """`feature_side`: the small CNN's largest feature-map side (0: one stride-2 stage); ResNets ignore it."""
    if name == "small-cnn":
        if imagenet_input:
            raise ValueError("pretrained weights need model = resnet18 (or a resnet50 classifier); small-cnn has none")
        return SmallCNN(in_channels, image_size, feature_side)
    if name in ("resnet18", "resnet50"):
        return ResNet(int(name[len("resnet"):]), in_channels, image_size < SMALL_IMAGE_SIDE, imagenet_input)
    raise ValueError(f"unknown backbone {name!r}; valid: {', '.join(BACKBONES)}")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors file or a PyTorch file (read with weights_only=True: no code runs)."""
    if not path.is_file():
        raise PretrainedWeightsError(f"pretrained = {str(path)!r}: no such file; valid: a local torchvision ResNet state dict")
    try:
        if path.suffix == ".safetensors":
            return load_safetensors(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise PretrainedWeightsError(
            f"pretrained = {str(path)!r} is not a readable state dict ({type(err).__name__}: {err}); valid: a "
            ".safetensors file or a PyTorch file of plain tensors (torch.save(model.state_dict(), path))"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a training checkpoint that wraps the weights
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise PretrainedWeightsError(f"pretrained = {str(path)!r} does not hold a state dict (name -> tensor)")
    return state


def load_pretrained(backbone: nn.Module, path: str | Path, model_name: str) -> None:
    """Load torchvision-format ResNet weights (the `fc` head is ignored) into `backbone`'s trunk; a clear
    error for weights of another architecture or with missing keys."""
    path = Path(path).expanduser()
    named = {k.removeprefix("module."): v for k, v in read_state_dict(path).items()}
    state = {_from_torchvision_name(k): v for k, v in named.items() if not k.startswith("fc.")}
    trunk = backbone.state_dict()
    missing = sorted(set(trunk) - set(state))
    unexpected = sorted(set(state) - set(trunk))
    misshapen = sorted(k for k in set(trunk) & set(state) if trunk[k].shape != state[k].shape)
    if unexpected or misshapen:
        raise PretrainedWeightsError(
            f"pretrained = {str(path)!r} is not a torchvision {model_name} state dict: unexpected keys "
            f"{unexpected[:3]}, other shapes for {misshapen[:3]} (e.g. resnet50 weights for a resnet18 model); give "
            f"{model_name} weights or set model to their architecture"
        )
    if missing:
        raise PretrainedWeightsError(
            f"pretrained = {str(path)!r} lacks {len(missing)} of the {model_name} weights (e.g. {missing[:3]}); "
            "give a complete torchvision state dict"
        )
    backbone.load_state_dict(state)


class Classifier(nn.Module):
    """Backbone, global average pooling and a linear head: the FedAvg/FedProx/centralised model."""

    def __init__(self, backbone: nn.Module, num_classes: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.forward_features(x).mean(dim=(2, 3)))


def build_classifier(arch: str, image_shape: tuple[int, int, int], num_classes: int, feature_side: int) -> Classifier:
    channels, height, _ = image_shape
    return Classifier(build_backbone(arch, channels, height, feature_side=feature_side), num_classes)
