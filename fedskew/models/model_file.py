"""Self-contained model files: the weights plus a metadata header that rebuilds the model without the run.

A fedskew model file is a safetensors file. Its header's `fedskew` entry is JSON (`ModelCard`): the
method, backbone, class names, label kind, image shape, input normalisation, decision rule and the
run config the model was built from. FedNCA-ML's fixed simplex ETF (a non-persistent buffer, so not in
the state dict) is stored as the tensor `fedskew.etf`; a `factory-p2p` file holds every site expert
(`experts.K.*`) and predicts with their Product of Experts.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from fedskew.config import RunConfig, current_run_config
from fedskew.methods import METHODS, method_named, method_of
from fedskew.metrics import DEFAULT_THRESHOLD
from fedskew.models.backbones import build_classifier
from fedskew.models.build import build_model
from fedskew.models.ensemble import ExpertEnsemble

FORMAT = "fedskew-model/1"
METADATA_KEY = "fedskew"
ETF_TENSOR = "fedskew.etf"


class ModelFileError(ValueError):
    """A file is not a readable fedskew model file; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ModelCard:
    method: str
    model: str  # the backbone / classifier architecture
    class_names: tuple[str, ...]
    label_kind: str  # "multi" | "single"
    image_shape: tuple[int, int, int]  # (C, H, W) the model takes
    normalisation: str  # what is done to [0, 1] pixels inside the model
    run_config: dict
    experts: int = 0  # factory-p2p: the number of site experts in the Product of Experts
    round: int | None = None
    selected_by: str = ""
    # Multi-label: the decision threshold shared by all classes, the one the round's metrics were taken at
    # (chosen on validation, or the run's fixed `threshold`); None for single-label models.
    threshold: float | None = None
    # factory / factory-p2p: the small CNN's `feature-side` the classifier was built with. Files written
    # before the classifier followed `feature-side` lack it: theirs had one stride-2 stage (0).
    factory_feature_side: int = 0

    @property
    def multilabel(self) -> bool:
        return self.label_kind == "multi"

    @property
    def decision(self) -> str:
        if self.multilabel:
            return f"every class whose sigmoid probability is > {self.threshold}"
        return "the class with the highest softmax probability"

    def header(self) -> dict[str, str]:
        return {METADATA_KEY: json.dumps({**asdict(self), "format": FORMAT, "decision": self.decision})}

    def at_round(self, server_round: int | None, selected_by: str = "", threshold: float | None = None) -> ModelCard:
        """The card of the model of `server_round`; `threshold` None keeps the card's threshold."""
        return replace(self, round=server_round, selected_by=selected_by,
                       threshold=self.threshold if threshold is None else float(threshold))  # fmt: skip


def run_model_card(cfg: RunConfig, class_names: tuple[str, ...], multilabel: bool, image_shape: tuple[int, int, int]) -> ModelCard:
    """The card of the model a run with `cfg` trains on this task."""
    factory = method_of(cfg).family == "factory"
    return ModelCard(
        method=cfg.method,
        model=cfg.factory.classifier if factory else cfg.model,
        class_names=tuple(class_names),
        label_kind="multi" if multilabel else "single",
        image_shape=tuple(int(v) for v in image_shape),
        normalisation=(
            "inside the model: grey repeated to RGB, then ImageNet mean/std (pretrained backbone)" if cfg.pretrained and not factory
            else "none: the model takes pixels scaled to [0, 1]"
        ),
        run_config=cfg.to_run_config(),
        # Until a round has chosen one: the run's fixed threshold, or 0.5.
        threshold=(DEFAULT_THRESHOLD if cfg.threshold == "validation" else float(cfg.threshold)) if multilabel else None,
        factory_feature_side=cfg.feature_side if factory else 0,
    )


def save_model_file(path: Path, state: dict[str, torch.Tensor], card: ModelCard, etf: torch.Tensor | None = None) -> Path:
    """Write weights + header atomically (a crash never leaves half a file)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    if etf is not None:
        tensors[ETF_TENSOR] = etf.detach().cpu().contiguous()
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial), metadata=card.header())
    partial.replace(path)
    return path


def read_model_file(path: str | Path) -> tuple[ModelCard, dict[str, torch.Tensor], torch.Tensor | None]:
    """(card, weights, ETF or None); ModelFileError when `path` is not a fedskew model file."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = (handle.metadata() or {}).get(METADATA_KEY)
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError) as err:
        raise ModelFileError(f"{path} is not a readable safetensors file: {err}") from None
    if header is None:
        raise ModelFileError(
            f"{path} has no '{METADATA_KEY}' metadata header: it holds weights only (written before model files were "
            "self-contained); valid: model.safetensors or model-selected.safetensors of a current run"
        )
    try:
        fields = json.loads(header)
    except (ValueError, RecursionError) as err:
        raise ModelFileError(f"{path}: the '{METADATA_KEY}' header is not JSON ({err}); valid: a file fedskew wrote") from None
    if not isinstance(fields, dict) or fields.pop("format", None) != FORMAT:
        raise ModelFileError(f"{path}: unknown model file format; this fedskew reads {FORMAT}")
    fields.pop("decision", None)  # derived from the other fields
    card_fields = dataclasses.fields(ModelCard)
    unknown = sorted(set(fields) - {field.name for field in card_fields})
    if unknown:
        raise ModelFileError(
            f"{path}: the header has unknown field(s) {', '.join(map(repr, unknown))}; known fields: format, decision, "
            f"{', '.join(field.name for field in card_fields)} (a file of another fedskew version, or an edited one)"
        )
    missing = [field.name for field in card_fields if field.default is dataclasses.MISSING and field.name not in fields]
    if missing:
        raise ModelFileError(f"{path}: the header lacks the field(s) {', '.join(missing)}; valid: a file fedskew wrote")
    method, names, shape = fields["method"], fields["class_names"], fields["image_shape"]
    if not (isinstance(method, str) and method in METHODS):
        raise ModelFileError(f"{path}: the header's 'method' = {str(method)[:100]!r} is invalid; valid: {', '.join(METHODS)}")
    if not isinstance(fields["run_config"], dict):
        raise ModelFileError(f"{path}: the header's 'run_config' is not a JSON object; valid: a file fedskew wrote")
    if not (isinstance(names, list) and names and all(isinstance(name, str) for name in names)):
        raise ModelFileError(f"{path}: the header's 'class_names' = {str(names)[:100]} is invalid; valid: a list of names")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape)):
        raise ModelFileError(f"{path}: the header's 'image_shape' = {str(shape)[:100]} is invalid; valid: [C, H, W], ints > 0")
    threshold = fields.get("threshold")
    if fields.get("label_kind") == "multi" and not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
                                                   and 0 < threshold < 1):  # fmt: skip
        raise ModelFileError(f"{path}: the header's multi-label 'threshold' = {threshold!r} is invalid; valid: a number in (0, 1)")
    side = fields.get("factory_feature_side", 0)
    if not isinstance(side, int) or isinstance(side, bool) or side < 0:
        raise ModelFileError(f"{path}: the header's 'factory_feature_side' = {side!r} is invalid; valid: an int >= 0")
    card = ModelCard(**{**fields, "class_names": tuple(fields["class_names"]), "image_shape": tuple(fields["image_shape"])})
    etf = tensors.pop(ETF_TENSOR, None)
    return card, tensors, etf


def weights_only(path: str | Path) -> dict[str, torch.Tensor]:
    """The model weights of a model file (without the ETF): what `resume-from` continues from."""
    with safe_open(str(path), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys() if key != ETF_TENSOR}


def build_from_card(card: ModelCard, etf: torch.Tensor | None) -> nn.Module:
    """The untrained model a card describes (the same constructors the run used)."""
    cfg = RunConfig.from_run_config(current_run_config(card.run_config))
    num_classes = len(card.class_names)
    if method_named(card.method).family == "factory":
        shape, side = card.image_shape, card.factory_feature_side
        if card.experts:
            return ExpertEnsemble([build_classifier(card.model, shape, num_classes, side) for _ in range(card.experts)])
        return build_classifier(card.model, shape, num_classes, side)
    return build_model(cfg, num_classes, card.image_shape, etf=etf)


def load_model_file(path: str | Path) -> tuple[nn.Module, ModelCard]:
    """The trained model (eval mode) and its card."""
    card, state, etf = read_model_file(path)
    model = build_from_card(card, etf)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    misshapen = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
    if missing or unexpected or misshapen:
        raise ModelFileError(
            f"{path}: the weights do not fit the {card.method} / {card.model} model its header describes: missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}, other shapes {sorted(misshapen)[:3]} (a corrupt or edited file)"
        )
    model.load_state_dict(state)
    return model.eval(), card
