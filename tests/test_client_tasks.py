"""Site-side functions called by the ClientApp handlers, exercised without Flower."""

import numpy as np
import pytest
import torch

from fedskew.client_tasks import (
    OPTIMIZER_SITE_STATE,
    VAL_COUNTS_KEY,
    evaluate_site,
    load_optimizer_arrays,
    optimizer_arrays,
    received_etf,
    received_proximal_mu,
    site_survey,
    train_site,
)
from fedskew.config import RunConfig
from fedskew.data.sites import simulated_site
from fedskew.metrics import THRESHOLD_GRID
from fedskew.models.build import build_model, server_etf
from fedskew.models.fednca import etf_fingerprint, simplex_etf

CFG = RunConfig.from_run_config({"method": "fednca", "batch-size": 64, "num-server-rounds": 2})


def test_a_malformed_etf_is_refused_with_the_reason():
    good = simplex_etf(10, 64, seed=0).numpy()
    assert torch.equal(received_etf(good, 10), torch.from_numpy(good))
    bent = good.copy()
    bent[:, 0] = bent[:, 1]  # two identical prototypes: not equiangular
    with pytest.raises(ValueError, match="cos"):
        received_etf(bent, 10)
    with pytest.raises(ValueError, match="shape"):
        received_etf(good[:, :9], 10)
    with pytest.raises(ValueError, match="refusing the server's ETF"):
        received_etf(good.ravel(), 10)
    nan = good.copy()
    nan[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN|finite"):
        received_etf(nan, 10)


def test_fednca_site_round_trains_reports_etf_fingerprint_and_leaves_etf_out_of_the_update():
    site = simulated_site(CFG, 0, 10)
    etf = server_etf(CFG, site.num_classes, site.train_images.shape[1:])
    torch.manual_seed(0)
    state = build_model(CFG, site.num_classes, site.train_images.shape[1:], etf=etf).state_dict()
    new_state, metrics = train_site(CFG, site, state, server_round=1, proximal_mu=0.0, etf=etf.numpy())
    assert set(new_state) == set(state)  # the ETF (non-persistent buffers) never travels back
    assert not any("prototypes" in k or "queries" in k for k in new_state)
    assert metrics["etf-crc32"] == etf_fingerprint(etf)
    assert metrics["num-examples"] == len(site.train_labels)
    assert any(not torch.equal(new_state[k], state[k]) for k in state)
    val = evaluate_site(CFG, site, new_state, etf=etf.numpy())
    # Only counts leave the site: tp, fp, fn per grid threshold and class, which add up to its validation labels.
    assert set(val) == {VAL_COUNTS_KEY, "num-examples", "unit-weight"}
    counts = np.array(val[VAL_COUNTS_KEY]).reshape(len(THRESHOLD_GRID), site.num_classes, 3)
    np.testing.assert_array_equal(counts[..., 0] + counts[..., 2], np.broadcast_to(site.val_labels.sum(0), counts.shape[:2]))
    assert np.all(np.diff(counts[..., 0] + counts[..., 1], axis=0) <= 0)  # a higher threshold predicts no more labels


def test_site_survey_reports_counts_only():
    site = simulated_site(CFG, 3, 10)
    survey = site_survey(CFG, site)
    assert survey["site-id"] == 3 and survey["num-sites"] == 10
    assert sum(np.array(survey["label-counts"]) == 0) >= CFG.missing_classes
    assert len(survey["cooccurrence"]) == site.num_classes**2


def test_fedprox_takes_mu_from_the_servers_message_and_a_missing_mu_is_an_error():
    fedprox = RunConfig.from_run_config({"method": "fedprox", "mosaic-grid": 0, "partition": "iid"})
    assert received_proximal_mu(fedprox, {"proximal-mu": 0.25, "server-round": 1}) == 0.25
    with pytest.raises(ValueError, match="carries no 'proximal-mu'"):
        received_proximal_mu(fedprox, {"server-round": 1})
    assert received_proximal_mu(CFG, {"server-round": 1}) == 0.0  # fednca: no proximal term


def test_kept_adamw_state_continues_across_rounds_through_the_node_state_record():
    cfg = RunConfig.from_run_config({"method": "fednca", "batch-size": 64, "local-epochs": 1,
                                     "num-server-rounds": 2, "fednca.keep-optimizer-state": True})
    site = simulated_site(cfg, 0, 10)
    steps = -(-len(site.train_labels) // cfg.batch_size)
    etf = server_etf(cfg, site.num_classes, site.train_images.shape[1:])
    torch.manual_seed(0)
    state = build_model(cfg, site.num_classes, site.train_images.shape[1:], etf=etf).state_dict()
    kept = RecordStore()
    after_one, _ = train_site(cfg, site, state, server_round=1, proximal_mu=0.0, etf=etf.numpy(), site_state=kept)
    assert kept.get(OPTIMIZER_SITE_STATE)["0.step"].item() == steps and "0.exp_avg_sq" in kept.get(OPTIMIZER_SITE_STATE)
    continued, _ = train_site(cfg, site, after_one, server_round=2, proximal_mu=0.0, etf=etf.numpy(), site_state=kept)
    assert kept.get(OPTIMIZER_SITE_STATE)["0.step"].item() == 2 * steps
    restarted, _ = train_site(cfg, site, after_one, server_round=2, proximal_mu=0.0, etf=etf.numpy(), site_state=RecordStore())
    assert any(not torch.allclose(continued[k].float(), restarted[k].float()) for k in continued)


def test_optimizer_state_saved_and_restored_is_a_copy_that_training_leaves_unchanged():
    # Two optimisers restored from one saved state (two sites given the same averaged moments) must each start
    # from it: neither saving nor restoring may hand out tensors that a later step updates in place.
    first = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([first], lr=0.1)
    first.grad = torch.ones(3)
    optimizer.step()
    saved = optimizer_arrays(optimizer)
    snapshot = {k: v.clone() for k, v in saved.items()}
    first.grad = torch.full((3,), 2.0)
    optimizer.step()  # the saved state is a snapshot, not the live moments
    for grad in (5.0, -5.0):
        other = torch.nn.Parameter(torch.ones(3))
        restored = torch.optim.AdamW([other], lr=0.1)
        load_optimizer_arrays(restored, saved)
        other.grad = torch.full((3,), grad)
        restored.step()
        assert restored.state[other]["step"].item() == 2  # continued from step 1, not from the other's 2
    assert all(torch.equal(saved[k], snapshot[k]) for k in saved)


class RecordStore:
    """The site store as the ClientApp keeps it: every put goes through an ArrayRecord (context.state)."""

    def __init__(self):
        self.records = {}

    def get(self, name):
        return self.records[name].to_torch_state_dict() if name in self.records else None

    def put(self, name, tensors):
        from flwr.app import ArrayRecord

        self.records[name] = ArrayRecord({k: v.contiguous() for k, v in tensors.items()})


@pytest.mark.parametrize("method", ["fednca", "fedavg"])
def test_a_site_trains_on_augmented_images_reproducibly(method):
    def one_round(augment: str) -> dict[str, torch.Tensor]:
        cfg = RunConfig.from_run_config({"method": method, "batch-size": 64, "num-server-rounds": 2, "augment": augment})
        site = simulated_site(cfg, 0, 10)
        etf = server_etf(cfg, site.num_classes, site.train_images.shape[1:]) if method == "fednca" else None
        torch.manual_seed(0)
        state = build_model(cfg, site.num_classes, site.train_images.shape[1:], etf=etf).state_dict()
        return train_site(cfg, site, state, server_round=1, proximal_mu=0.0,
                          etf=None if etf is None else etf.numpy())[0]

    plain, shifted, shifted_again = one_round("none"), one_round("shift"), one_round("shift")
    assert all(torch.equal(shifted[name], shifted_again[name]) for name in shifted)
    assert any(not torch.equal(plain[name], shifted[name]) for name in plain if plain[name].is_floating_point())
