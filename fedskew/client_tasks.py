"""Site-side work as plain functions (no Flower types): what each ClientApp handler calls."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
import torch
from torch import nn

from fedskew.config import RunConfig
from fedskew.drift import (
    SCAFFOLD_DELTA_PREFIX,
    feddyn_correction,
    feddyn_site_update,
    gradient_moments,
    gradient_shift,
    scaffold_correction,
    scaffold_site_update,
    zeros_like_parameters,
)
from fedskew.data.partition import label_cooccurrence, label_counts
from fedskew.data.site_folder import DATA_DIR_KEY, DeployedSite, deployed_site, site_in_simulation
from fedskew.data.sites import SiteData, load_partition
from fedskew.models.build import build_model
from fedskew.fednca_site import checked_etf, etf_echo, fednca_loss, fednca_optimizer
from fedskew.methods import method_of
from fedskew.metrics import counted_thresholds, threshold_counts
from fedskew.protocol import SINGLE_LABEL_VAL_KEYS, UNIT_WEIGHT_KEY, VAL_COUNTS_KEY
from fedskew.training import (
    EVAL_BATCH_SIZE, augmented, classification_loss, evaluate, make_loader, pick_device, predict, sgd, train_local,
)

def load_site(cfg: RunConfig, node_config: dict) -> SiteData:
    """The site's own data: its folder (node config data-dir), or in simulation (partition-id /
    num-partitions) its site folder with dataset sites:<dir>, else its partition share."""
    if DATA_DIR_KEY in node_config:
        return deployed_site(cfg, node_config)
    if "partition-id" not in node_config or "num-partitions" not in node_config:
        raise ValueError(
            "this SuperNode has no data: give it --node-config \"data-dir='/path/to/site'\" (deployment) or "
            "\"partition-id=K num-partitions=N\" (simulation) "
            f"(node config seen: {dict(node_config)})"
        )
    return site_in_simulation(cfg, int(node_config["partition-id"]), int(node_config["num-partitions"]))


def site_survey(cfg: RunConfig, site: SiteData) -> dict:
    """Label statistics only (counts, never images) for the run's partition record, and the site's task
    shape (label kind, class names, image shape) for the server's agreement check."""
    all_idx = np.arange(len(site.train_labels))
    survey = {
        "site-id": site.site_id,
        "num-sites": site.num_sites,
        "train-size": len(site.train_labels),
        "val-size": len(site.val_labels),
        "label-counts": label_counts(site.train_labels, [all_idx], site.num_classes)[0].tolist(),
        # A deployed site has no simulated partition (and may not hold the dataset it was drawn from).
        "unassigned": 0 if isinstance(site, DeployedSite) else int(len(load_partition(cfg, site.num_sites).unassigned)),
        # What the run is named by: the run config's dataset (a partition share of it) or the sites' own folders.
        "data-source": "site-folder" if isinstance(site, DeployedSite) else "partition",
        # What the server needs to build the model when it holds no test data (test-data = "federated").
        "num-classes": site.num_classes,
        "image-shape": list(site.train_images.shape[1:]),
        # The server refuses a site whose label kind or label space differs from the run's.
        "multilabel": int(site.multilabel),
        "class-names": list(site.class_names),
    }
    if site.multilabel:
        survey["cooccurrence"] = label_cooccurrence(site.train_labels, all_idx).ravel().tolist()
    return survey


def received_etf(etf: np.ndarray | None, num_classes: int) -> torch.Tensor | None:
    """The server's ETF, checked before use (None when the run's method has none)."""
    return None if etf is None else checked_etf(etf, num_classes)


def _site_model(
    cfg: RunConfig, site: SiteData, state: dict[str, torch.Tensor], etf: np.ndarray | None = None
) -> nn.Module:
    model = build_model(cfg, site.num_classes, site.train_images.shape[1:], etf=received_etf(etf, site.num_classes))
    model.load_state_dict(state)
    return model


def local_optimisation(cfg: RunConfig, model: nn.Module, steps_per_round: int, server_round: int, augment_seed: int):
    """(optimizer, scheduler, loss_fn) for the run's model; the loss sees the images augmented as `augment`
    says, with draws seeded by `augment_seed`. FedNCA-ML's warm-up/decay schedule spans
    the whole run (num-server-rounds x steps_per_round), so each round continues it where the previous
    round stopped, or (fednca.schedule-span = "round") each round's steps alone; its centralised bound
    builds it once (round 1) over its whole run and trains every round with it."""
    if not cfg.fednca_model:
        momentum = 0.0 if method_of(cfg).plain_sgd else cfg.momentum
        return sgd(model, cfg.lr, momentum, cfg.weight_decay), None, augmented(classification_loss, cfg.augment, augment_seed)
    nca = cfg.fednca
    per_round = nca.schedule_span == "round" and method_of(cfg).family != "centralized"
    total_steps = steps_per_round if per_round else cfg.num_server_rounds * steps_per_round
    optimizer, scheduler = fednca_optimizer(
        model,
        total_steps=total_steps,
        lr=nca.lr,
        betas=(0.9, nca.beta2),
        weight_decay=nca.weight_decay,
        warmup_steps=warmup_steps(nca.warmup_epochs, steps_per_round / cfg.local_epochs, total_steps),
        step_offset=0 if per_round else (server_round - 1) * steps_per_round,
    )
    loss_fn = augmented(functools.partial(
        fednca_loss,
        rejection_weight=nca.rejection_weight,
        contrastive_weight=nca.contrastive_weight,
        margin=nca.margin,
        rejection_scope=nca.rejection_scope,
        tau=nca.tau,
        use_regularisers=nca.regularisers,
    ), cfg.augment, augment_seed)
    return optimizer, scheduler, loss_fn


def warmup_steps(warmup_epochs: float, steps_per_epoch: float, total_steps: int) -> int:
    """Steps of warm-up: `warmup_epochs` epochs' worth, at most half of `total_steps`. A fixed length in
    epochs rather than a share of the schedule: a longer run must not also warm up longer (a warm-up of
    10 % of a 20-round run, 6 epochs, kept the centralised bound at chance on shapes-multi)."""
    return min(round(warmup_epochs * steps_per_epoch), total_steps // 2)


class TensorStore(Protocol):
    """Where a site keeps tensors between rounds (fedskew.site_state.SiteState in the ClientApp)."""

    def get(self, name: str) -> dict[str, torch.Tensor] | None: ...

    def put(self, name: str, tensors: dict[str, torch.Tensor]) -> None: ...


SCAFFOLD_SITE_STATE = "scaffold-site-control"
FEDDYN_SITE_STATE = "feddyn-site-gradient"
OPTIMIZER_SITE_STATE = "optimizer-state"


def _parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def drift_correction(
    cfg: RunConfig, model: nn.Module, site_state: TensorStore | None, server_control: dict | None, steps: int
) -> tuple[Callable[[], None] | None, Callable[[], dict[str, torch.Tensor]]]:
    """(gradient hook, finish, restored) for SCAFFOLD and FedDyn, with `model` on its training device and
    at the global weights. finish() stores the site's new state and returns what the reply carries
    besides the model; restored says whether an earlier round's state was found. Other methods:
    (None, a finish that returns nothing, False)."""
    drift_state = method_of(cfg).drift_state
    if drift_state is None:
        return None, dict, False
    if site_state is None:
        raise ValueError(f"method {cfg.method} keeps state at the site between rounds; no state store was given")
    global_params = _parameters(model)
    if drift_state == "scaffold":
        if server_control is None:
            raise ValueError("method scaffold: the server's message carries no control variate")
        saved = site_state.get(SCAFFOLD_SITE_STATE)
        site_control = saved or zeros_like_parameters(model)
        hook = scaffold_correction(model, site_control, server_control)

        def finish() -> dict[str, torch.Tensor]:
            new, delta = scaffold_site_update(site_control, server_control, global_params, _parameters(model), steps, cfg.lr)
            site_state.put(SCAFFOLD_SITE_STATE, new)
            return {SCAFFOLD_DELTA_PREFIX + name: value for name, value in delta.items()}

        return hook, finish, saved is not None
    saved = site_state.get(FEDDYN_SITE_STATE)
    site_gradient = saved or zeros_like_parameters(model)
    hook = feddyn_correction(model, site_gradient, cfg.feddyn_alpha)

    def finish() -> dict[str, torch.Tensor]:
        site_state.put(FEDDYN_SITE_STATE, feddyn_site_update(site_gradient, global_params, _parameters(model), cfg.feddyn_alpha))
        return {}

    return hook, finish, saved is not None


def corrects_gradients(cfg: RunConfig) -> bool:
    """Whether the run config turns FedNCA-ML's control variates on (fednca.control-variates)."""
    return method_of(cfg).fednca_model and cfg.fednca.control_variates


def require_control_variates(cfg: RunConfig, request: str) -> None:
    """A site sends more than its model update, or lets the server steer its steps, only when its own run config
    says so; `request` names what the server asked."""
    if not corrects_gradients(cfg):
        raise ValueError(f"{request}, but this site's run config has method {cfg.method!r} with "
                         "fednca.control-variates off: check that the server and this site run the same run config")


def site_mean_gradient(
    cfg: RunConfig, site: SiteData, state: dict[str, torch.Tensor], *, server_round: int, etf: np.ndarray | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """The site's control variate for fednca.control-variates: its mean gradient of the training loss (augmented as
    the round's training is) over one pass of its training images at the global weights `state`, one tensor per
    trainable parameter, and the weights the server's mean uses. The weights and BatchNorm statistics are not
    changed."""
    require_control_variates(cfg, "the server asks for this site's mean gradient")
    device = pick_device(cfg.device)
    model = _site_model(cfg, site, state, etf).to(device)
    round_seed = cfg.seed + 1000 * server_round + site.site_id
    loader = make_loader(site.train_images, site.train_labels, cfg.batch_size, shuffle=False)
    _, _, loss_fn = local_optimisation(cfg, model, len(loader), server_round, augment_seed=round_seed)
    names, params = zip(*[(name, p) for name, p in model.named_parameters() if p.requires_grad])
    means, _, _ = gradient_moments(model, list(params), loader, loss_fn, device)
    return ({name: mean.cpu() for name, mean in zip(names, means)},
            {"num-examples": len(site.train_labels), UNIT_WEIGHT_KEY: 1})


def received_proximal_mu(cfg: RunConfig, train_config: Mapping) -> float:
    """FedProx's mu, which Flower's FedProx sends with every training message; other methods train without
    a proximal term. A fedprox message without it is an error, never a silent mu of 0."""
    if not method_of(cfg).proximal:
        return 0.0
    if "proximal-mu" not in train_config:
        raise ValueError(
            "method fedprox, but the server's training message carries no 'proximal-mu' (Flower's FedProx sends "
            "it); the server does not run FedProx: check that the server and this site run the same run config"
        )
    return float(train_config["proximal-mu"])


def optimizer_arrays(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimiser's per-parameter state (AdamW: step, moments) as flat "<param index>.<name>" tensors."""
    return {
        f"{index}.{name}": torch.as_tensor(value).detach().cpu().clone()
        for index, values in optimizer.state_dict()["state"].items()
        for name, value in values.items()
    }


def load_optimizer_arrays(optimizer: torch.optim.Optimizer, arrays: dict[str, torch.Tensor]) -> None:
    """Restore per-parameter state saved by optimizer_arrays; hyper-parameters (lr, schedule) stay the new ones.
    The optimiser gets copies: torch keeps a loaded tensor whose dtype and device already match and updates it
    in place, which would change `arrays` under whoever else holds them (another site given the same state)."""
    nested: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in arrays.items():
        index, _, name = key.partition(".")
        nested.setdefault(int(index), {})[name] = value.clone()
    optimizer.load_state_dict({"state": nested, "param_groups": optimizer.state_dict()["param_groups"]})


def train_site(
    cfg: RunConfig,
    site: SiteData,
    state: dict[str, torch.Tensor],
    *,
    server_round: int,
    proximal_mu: float,
    etf: np.ndarray | None = None,
    site_state: TensorStore | None = None,
    server_control: dict[str, torch.Tensor] | None = None,
    control_shift: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """One round of local training from the global weights; returns new weights and metrics.
    SCAFFOLD and FedDyn read and update their site state in `site_state`; SCAFFOLD also needs the
    server's control variate, and its reply carries delta_c next to the weights. With
    fednca.keep-optimizer-state the site's AdamW state continues from its previous round (kept in
    `site_state`, never sent). With fednca.control-variates the server sends `control_shift` (c - c_i),
    added to every local gradient."""
    device = pick_device(cfg.device)
    model = _site_model(cfg, site, state, etf).to(device)
    round_seed = cfg.seed + 1000 * server_round + site.site_id
    loader = make_loader(site.train_images, site.train_labels, cfg.batch_size, shuffle=True, seed=round_seed)
    steps = cfg.local_epochs * math.ceil(len(site.train_labels) / cfg.batch_size)
    optimizer, scheduler, loss_fn = local_optimisation(cfg, model, steps, server_round, augment_seed=round_seed)
    before_step, finish, restored = drift_correction(cfg, model, site_state, server_control, steps)
    if control_shift is not None:
        require_control_variates(cfg, "the server's training message carries a gradient correction")
        before_step = gradient_shift(model, control_shift, "the server's gradient correction (c - c_i)")
    keep_optimizer = method_of(cfg).fednca_model and cfg.fednca.keep_optimizer_state
    if keep_optimizer:
        if site_state is None:
            raise ValueError("fednca.keep-optimizer-state keeps state at the site between rounds; no state store was given")
        load_optimizer_arrays(optimizer, site_state.get(OPTIMIZER_SITE_STATE) or {})
    stats = train_local(
        model,
        loader,
        epochs=cfg.local_epochs,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=loss_fn,
        device=device,
        proximal_mu=proximal_mu,
        before_step=before_step,
    )
    extra = finish()
    if keep_optimizer:
        site_state.put(OPTIMIZER_SITE_STATE, optimizer_arrays(optimizer))
    metrics = {
        "train_loss": stats["train_loss"],
        "train_seconds": stats["train_seconds"],
        "num-examples": stats["num_examples"],
        UNIT_WEIGHT_KEY: 1,
    }
    if method_of(cfg).drift_state is not None:
        # Averaged by the server: the share of sites that found their state from the previous round.
        metrics["site-state-restored"] = float(restored)
    if corrects_gradients(cfg):
        # Averaged by the server: the share of sites whose steps were corrected this round.
        metrics["gradient-corrected"] = float(control_shift is not None)
    if method_of(cfg).proximal:
        metrics["proximal-mu"] = proximal_mu  # the mu this site trained with, recorded by the server
    if etf is not None:
        # Lets the server confirm that every site trained against the exact ETF it holds.
        metrics.update(etf_echo(etf))
    # One line per site and round where the site's operator (and, in simulation, `flwr run --stream`) sees it.
    print(f"site {site.site_id}: round {server_round} trained, {stats['num_examples']} examples, "
          f"loss {stats['train_loss']:.4f}, {stats['train_seconds']:.1f}s", flush=True)
    return {**{k: v.cpu() for k, v in model.state_dict().items()}, **extra}, metrics


# What a multi-label validation report carries: per-class tp/fp/fn counts at every counted threshold.
def validation_report(
    model: nn.Module, images: np.ndarray, labels: np.ndarray, *, device: torch.device, threshold: str | float
) -> dict[str, float | list[int]]:
    """A model's validation evidence on (images, labels), the same wherever the images are (a site's split,
    the centralised bound's pooled split, the server's val-data). Single-label: accuracy and balanced
    accuracy (defined on any non-empty split, so every site reports the same keys, as Flower's averaging
    requires). Multi-label: only the flattened per-class true/false-positive and false-negative counts at
    every threshold of counted_thresholds(run-config `threshold`); the server sums them over sites, chooses
    the decision threshold and derives F1 from the sums (AUC would not be defined on a site lacking a label)."""
    if labels.ndim == 2:
        y_true, probs = predict(model, make_loader(images, labels, EVAL_BATCH_SIZE, shuffle=False), device, multilabel=True)
        return {VAL_COUNTS_KEY: threshold_counts(y_true, probs, counted_thresholds(threshold)).ravel().tolist()}
    metrics = evaluate(model, images, labels, device=device)
    return {key: float(metrics[key.removeprefix("val_")]) for key in SINGLE_LABEL_VAL_KEYS}


def evaluate_site(cfg: RunConfig, site: SiteData, state: dict[str, torch.Tensor], etf: np.ndarray | None = None) -> dict:
    """Global model on the site's local validation split: its validation report and example count."""
    model = _site_model(cfg, site, state, etf)
    report = validation_report(model, site.val_images, site.val_labels, device=pick_device(cfg.device), threshold=cfg.threshold)
    return {**report, "num-examples": len(site.val_labels), UNIT_WEIGHT_KEY: 1}
