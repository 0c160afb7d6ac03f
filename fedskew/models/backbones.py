"""Image backbones that expose their last feature map, plus the plain linear-head classifier.

Every backbone returns (B, d, h, w) from `forward_features` so FedNCA-ML can read the map as
h*w tokens, while the baselines pool it into one feature vector.
"""

from __future__ import annotations

import torch
from torch import nn
from torchvision.models import resnet18, resnet50

BACKBONES = ("small-cnn", "resnet18", "resnet50")
SMALL_IMAGE_SIDE = 96
RESNETS = {18: (resnet18, 512), 50: (resnet50, 2048)}  # depth -> (torchvision constructor, feature dim)


def conv_bn_relu(in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """Four 3x3 conv layers, one stride-2: fast on a CPU, keeps an (H/2 x W/2) token grid."""

    def __init__(self, in_channels: int, width: int = 32):
        super().__init__()
        self.feature_dim = 2 * width
        self.features = nn.Sequential(
            conv_bn_relu(in_channels, width),
            conv_bn_relu(width, width),
            conv_bn_relu(width, 2 * width, stride=2),
            conv_bn_relu(2 * width, 2 * width),
        )

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


class ResNet(nn.Module):
    """A torchvision ResNet trunk; small images (< 96 px) get the CIFAR stem: 3x3 stride-1 conv, no max-pool."""

    def __init__(self, depth: int, in_channels: int, small_images: bool = True):
        super().__init__()
        constructor, self.feature_dim = RESNETS[depth]
        net = constructor(weights=None)
        if small_images:
            net.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
            net.maxpool = nn.Identity()
        elif in_channels != 3:
            net.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.stages = nn.Sequential(net.layer1, net.layer2, net.layer3, net.layer4)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))


def build_backbone(name: str, in_channels: int, image_size: int) -> nn.Module:
    if name == "small-cnn":
        return SmallCNN(in_channels)
    if name in ("resnet18", "resnet50"):
        return ResNet(int(name[len("resnet"):]), in_channels, small_images=image_size < SMALL_IMAGE_SIDE)
    raise ValueError(f"unknown backbone {name!r}; valid: {', '.join(BACKBONES)}")


class Classifier(nn.Module):
    """Backbone, global average pooling and a linear head: the FedAvg/FedProx/centralised model."""

    def __init__(self, backbone: nn.Module, num_classes: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.forward_features(x).mean(dim=(2, 3)))
