"""`pretrained`: a local torchvision ResNet state dict starts the backbone; nothing is downloaded, and a
wrong or incomplete file is a clear error."""

import pytest
import torch
from safetensors.torch import save_file
from torchvision.models import resnet18, resnet50

from fedskew.config import ConfigError, RunConfig
from fedskew.models.backbones import IMAGENET_MEAN, IMAGENET_STD, PretrainedWeightsError
from fedskew.models.build import build_model, start_backbone


def _cfg(path, **extra):
    return RunConfig.from_run_config({"method": "fedavg", "model": "resnet18", "pretrained": str(path), **extra})


@pytest.fixture(scope="module")
def torchvision_resnet18():
    torch.manual_seed(0)
    return resnet18(weights=None).eval()


@pytest.mark.parametrize("suffix", ["safetensors", "pt"])
def test_torchvision_weights_start_the_backbone_and_grey_images_become_normalised_rgb(tmp_path, torchvision_resnet18, suffix):
    path = tmp_path / f"r18.{suffix}"
    state = {k: v.contiguous() for k, v in torchvision_resnet18.state_dict().items()}
    save_file(state, str(path)) if suffix == "safetensors" else torch.save(state, path)
    model = start_backbone(_cfg(path), build_model(_cfg(path), 3, (1, 32, 32)), (1, 32, 32)).eval()
    backbone = model.backbone
    assert torch.equal(backbone.stem[0].weight, torchvision_resnet18.conv1.weight)
    assert torch.equal(backbone.stages[3][1].bn2.running_var, torchvision_resnet18.layer4[1].bn2.running_var)
    grey = torch.rand(2, 1, 32, 32)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    assert torch.allclose(backbone.input(grey), (grey.repeat(1, 3, 1, 1) - mean) / std)
    # The trunk computes exactly torchvision's features (its fc replaced by the method's head).
    with torch.no_grad():
        ours = backbone.forward_features(grey).mean(dim=(2, 3))
        torchvision_resnet18.fc = torch.nn.Identity()
        theirs = torchvision_resnet18((grey.repeat(1, 3, 1, 1) - mean) / std)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert model(grey).shape == (2, 3)


def test_weights_of_another_architecture_or_missing_keys_are_refused(tmp_path, torchvision_resnet18):
    save_file({k: v.contiguous() for k, v in resnet50(weights=None).state_dict().items()}, str(tmp_path / "r50.safetensors"))
    cfg = _cfg(tmp_path / "r50.safetensors")
    with pytest.raises(PretrainedWeightsError, match="is not a torchvision resnet18 state dict.*resnet50 weights"):
        start_backbone(cfg, build_model(cfg, 3, (3, 32, 32)), (3, 32, 32))
    partial = {k: v for k, v in torchvision_resnet18.state_dict().items() if not k.startswith("layer4.")}
    torch.save(partial, tmp_path / "partial.pt")
    cfg = _cfg(tmp_path / "partial.pt")
    with pytest.raises(PretrainedWeightsError, match=r"lacks \d+ of the resnet18 weights"):
        start_backbone(cfg, build_model(cfg, 3, (3, 32, 32)), (3, 32, 32))
    torch.save({"layer": torch.nn.Linear(2, 2)}, tmp_path / "pickled-module.pt")  # code, not tensors: never unpickled
    cfg = _cfg(tmp_path / "pickled-module.pt")
    with pytest.raises(PretrainedWeightsError, match="is not a readable state dict"):
        start_backbone(cfg, build_model(cfg, 3, (3, 32, 32)), (3, 32, 32))
    with pytest.raises(PretrainedWeightsError, match="no such file"):
        start_backbone(_cfg(tmp_path / "nowhere.pt"), build_model(_cfg(tmp_path / "nowhere.pt"), 3, (3, 32, 32)), (3, 32, 32))
    with pytest.raises(ConfigError, match="'model' = 'small-cnn' is invalid; valid: resnet18 when pretrained"):
        RunConfig.from_run_config({"pretrained": "w.pt", "model": "small-cnn"})
