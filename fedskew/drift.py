"""Client-drift corrections of SCAFFOLD (Karimireddy et al., ICML 2020, option II) and FedDyn
(Acar et al., ICLR 2021) as plain tensor maths: no Flower types, so the site and server sides are
testable on hand-worked numbers.

Both act on the model's trainable parameters only (BatchNorm statistics are averaged as in FedAvg).
Both assume plain local SGD, as in their papers: SCAFFOLD's control-variate estimate
(x - y) / (K lr) is the mean corrected gradient only when each step moves by lr times it, which
momentum breaks; so these methods train without momentum.

Notation: x = the round's global parameters, y = a site's parameters after K local steps at lr.

SCAFFOLD: the site keeps its control variate c_i (zeros at first), the server c. Every local
gradient g becomes g - c_i + c; afterwards c_i+ = c_i - c + (x - y) / (K lr), and the site sends
delta_c = c_i+ - c_i. The server adds participation * average(delta_c) to c, participation =
|replying sites| / |all sites|, and its new model is the average of the y.

Fresh control variates (FedSVRG, Konecny et al. 2016; FedLin, Mitra et al., NeurIPS 2021): SCAFFOLD's
correction with c_i measured, not estimated. Before a round's training every site sends its mean gradient
c_i over one pass of its training images at the global weights x; c is their weighted mean, and each site
trains with g - c_i + c, the server sending it the shift c - c_i. The measurement holds for any local
optimiser (FedNCA-ML's sites use AdamW), which SCAFFOLD's (x - y) / (K lr) does not.

FedDyn: the site keeps h_i (zeros at first), the gradient of its linear penalty, and minimises
L_i(theta) - <h_i, theta> + alpha/2 ||theta - x||^2, i.e. every local gradient g becomes
g - h_i + alpha (theta - x); afterwards h_i+ = h_i - alpha (y - x). The server keeps h:
h+ = h - alpha * participation * (average(y) - x), and its new model is average(y) - h+ / alpha.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

Tensors = dict[str, torch.Tensor]

SCAFFOLD_DELTA_PREFIX = "scaffold-control-delta."


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def zeros_like_parameters(model: nn.Module) -> Tensors:
    return {name: torch.zeros_like(p, device="cpu") for name, p in model.named_parameters() if p.requires_grad}


def _require_same_keys(what: str, tensors: Mapping[str, torch.Tensor], model: nn.Module) -> None:
    expected = set(trainable_names(model))
    if set(tensors) != expected:
        missing, unknown = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"{what} does not match the model's parameters: missing {missing[:5]}, unknown {unknown[:5]}")


def gradient_correction(model: nn.Module, offset: Callable[[str, torch.Tensor], torch.Tensor]) -> Callable[[], None]:
    """A hook to call between backward() and optimizer.step(): adds offset(name, param) to each grad."""

    def apply() -> None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.requires_grad and param.grad is not None:
                    param.grad.add_(offset(name, param))

    return apply


def gradient_shift(model: nn.Module, shift: Tensors, what: str) -> Callable[[], None]:
    """A gradient hook g -> g + shift; `shift` must hold one finite tensor of each trainable parameter's shape
    (`what` names it in the error)."""
    _require_same_keys(what, shift, model)
    for name, param in model.named_parameters():
        if name in shift and (shift[name].shape != param.shape or not torch.isfinite(shift[name]).all()):
            raise ValueError(f"{what}: '{name}' has shape {tuple(shift[name].shape)}"
                             f"{'' if shift[name].shape != param.shape else ' and NaN or infinite values'}; "
                             f"valid: finite values of the parameter's shape {tuple(param.shape)}")
    device = next(model.parameters()).device
    moved = {name: value.to(device, torch.float32) for name, value in shift.items()}
    return gradient_correction(model, lambda name, _param: moved[name])


def scaffold_correction(model: nn.Module, site_control: Tensors, server_control: Tensors) -> Callable[[], None]:
    """SCAFFOLD's local gradient g -> g - c_i + c."""
    _require_same_keys("the site's SCAFFOLD control variate", site_control, model)
    _require_same_keys("the server's SCAFFOLD control variate", server_control, model)
    return gradient_shift(model, {name: server_control[name] - site_control[name] for name in site_control},
                          "SCAFFOLD's correction")


def gradient_moments(model: nn.Module, params: list[nn.Parameter], batches: Iterable, loss_fn,
                     device: torch.device, limit: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Mean gradient and mean squared gradient of each of `params` over `batches` (the first `limit` of them) at
    the current weights, in training mode, and the batch count; the weights, BatchNorm statistics and .grad
    fields are left as they were."""
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    saved_grads = [p.grad for p in model.parameters()]
    sums = [torch.zeros_like(p) for p in params]
    squares = [torch.zeros_like(p) for p in params]
    model.train()
    count = 0
    for x, y in itertools.islice(batches, limit):
        model.zero_grad(set_to_none=True)
        loss_fn(model, x.to(device), y.to(device)).backward()
        for p, total, square in zip(params, sums, squares):
            if p.grad is not None:
                total.add_(p.grad)
                square.add_(p.grad * p.grad)
        count += 1
    if count == 0:
        raise ValueError("no batch to take a gradient on (the site holds no training images)")
    model.load_state_dict(buffers, strict=False)
    for p, grad in zip(model.parameters(), saved_grads):
        p.grad = grad
    return [total / count for total in sums], [square / count for square in squares], count


def weighted_control(site_controls: Mapping[object, Tensors], weights: Mapping[object, float]) -> Tensors:
    """c: the `weights`-weighted mean of the sites' controls c_i."""
    total = sum(weights[site] for site in site_controls)
    if not site_controls or total <= 0:
        raise ValueError("control variates need at least one site's control with a positive weight")
    first = next(iter(site_controls.values()))
    return {name: sum(weights[site] / total * controls[name] for site, controls in site_controls.items()) for name in first}


def control_shifts(site_controls: Mapping[object, Tensors], weights: Mapping[object, float]) -> dict[object, Tensors]:
    """Each site's shift c - c_i, c = weighted_control(site_controls, weights)."""
    c = weighted_control(site_controls, weights)
    return {site: {name: c[name] - controls[name] for name in c} for site, controls in site_controls.items()}


def scaffold_site_update(site_control: Tensors, server_control: Tensors, x: Tensors, y: Tensors,
                         steps: int, lr: float) -> tuple[Tensors, Tensors]:
    """(c_i+, delta_c = c_i+ - c_i) after `steps` local SGD steps at `lr` moved x to y."""
    if steps < 1 or lr <= 0:
        raise ValueError(f"SCAFFOLD needs steps >= 1 and lr > 0, got steps={steps}, lr={lr}")
    new = {name: site_control[name] - server_control[name] + (x[name] - y[name]) / (steps * lr) for name in site_control}
    return new, {name: new[name] - site_control[name] for name in site_control}


def scaffold_server_update(server_control: Tensors, mean_delta: Tensors, participation: float) -> Tensors:
    """c+ = c + participation * average(delta_c)."""
    return {name: server_control[name] + participation * mean_delta[name] for name in server_control}


def feddyn_correction(model: nn.Module, site_gradient: Tensors, alpha: float) -> Callable[[], None]:
    """FedDyn's local gradient g -> g - h_i + alpha (theta - x), x = the parameters at the call."""
    _require_same_keys("the site's FedDyn state", site_gradient, model)
    device = next(model.parameters()).device
    anchor = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    h = {name: t.to(device) for name, t in site_gradient.items()}
    return gradient_correction(model, lambda name, param: alpha * (param.detach() - anchor[name]) - h[name])


def feddyn_site_update(site_gradient: Tensors, x: Tensors, y: Tensors, alpha: float) -> Tensors:
    """h_i+ = h_i - alpha (y - x)."""
    return {name: site_gradient[name] - alpha * (y[name] - x[name]) for name in site_gradient}


def feddyn_server_update(server_gradient: Tensors, x: Tensors, mean_y: Tensors, alpha: float,
                         participation: float) -> tuple[Tensors, Tensors]:
    """(h+, new global parameters): h+ = h - alpha participation (mean_y - x); theta = mean_y - h+ / alpha."""
    if alpha <= 0:
        raise ValueError(f"FedDyn alpha must be > 0, got {alpha}")
    h = {name: server_gradient[name] - alpha * participation * (mean_y[name] - x[name]) for name in server_gradient}
    return h, {name: mean_y[name] - h[name] / alpha for name in server_gradient}
