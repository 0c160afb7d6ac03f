"""What a FederatedFactory site answers to the server's messages: the ClientApp's handlers call these with the
message content and get the reply content back, with no Flower types beyond the records (fedskew.protocol).
Their settings are fedskew's RunConfig or, in a ClientApp of one's own, the FactoryRun built from the values
the server's FederatedFactory strategy was given (docs/api.md)."""

from __future__ import annotations

import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from fedskew.data.sites import SiteData
from fedskew.factory.classifier import check_expert_weights, run_classifier
from fedskew.factory.intensity import class_histograms
from fedskew.factory.library import library_from_manifest
from fedskew.factory.run import FactorySettings
from fedskew.factory.site import (
    generator_payload_limit,
    guide_steps,
    planned_module,
    train_site_expert,
    train_site_generators,
    trained_guides,
    uploaded_modules,
)
from fedskew.factory.site_validation import class_scores
from fedskew.protocol import (
    CLASSIFIER_KEY,
    EXPERT_KEY,
    GUIDE_MANIFEST_KEY,
    GUIDE_PREFIX,
    INTENSITY_KEY,
    METRICS_KEY,
    SCORES_KEY,
    UploadRejected,
    decode_modules,
    encode_modules,
    packed_size_limit,
    packed_weights,
    unpacked_weights,
)


def site_upload(cfg: FactorySettings, site: SiteData, device: torch.device) -> RecordDict:
    """Round 1 at a site: train and audit its generators and upload those within factory.max-memorization
    (the manifest names the withheld ones and why); raises an UploadRefusal when none is left or a
    generator would exceed factory.max-epsilon."""
    modules, metrics = train_site_generators(cfg, site, device)
    modules, withheld = uploaded_modules(cfg, site, modules)
    guides = []
    if guide_steps(cfg):
        modules, guides, withheld, guide_metrics = trained_guides(cfg, site, modules, withheld, device)
        metrics.update(guide_metrics)
    shape = list(site.train_images.shape[1:])
    manifest = {"site-id": site.site_id, "image-shape": shape, "modules": [m.metadata() for m in modules], "withheld": withheld}
    content = encode_modules(manifest, modules)
    if guides:
        guide_manifest = {"site-id": site.site_id, "image-shape": shape, "modules": [g.metadata() for g in guides]}
        encode_modules(guide_manifest, guides, content, GUIDE_MANIFEST_KEY, GUIDE_PREFIX)
    content[METRICS_KEY] = MetricRecord({**metrics, "modules": len(modules), "withheld": len(withheld), "site-id": site.site_id})
    if cfg.factory.match_intensity:
        histograms = class_histograms(site.train_images, site.train_labels, site.num_classes)
        content[INTENSITY_KEY] = ArrayRecord({INTENSITY_KEY: Array(histograms)})
    return content


def site_expert(cfg: FactorySettings, site: SiteData, content: RecordDict, device: torch.device) -> RecordDict:
    """Round 2 at a site: check the relayed library like the server checked the uploads (every module's
    config must be the one the run config makes), train the expert."""
    image_shape = tuple(site.train_images.shape[1:])
    manifest, states = decode_modules(content, generator_payload_limit(cfg, image_shape, site.num_classes))
    library = library_from_manifest(
        manifest, states,
        lambda site_id, classes, counts: planned_module(cfg, site_id, classes, counts, image_shape, site.num_classes),
    )  # fmt: skip
    if library.num_classes != site.num_classes or library.image_shape != image_shape:
        raise UploadRejected(
            f"the relayed library is for {library.num_classes} classes of {library.image_shape} images; "
            f"this site has {site.num_classes} classes of {image_shape}"
        )
    state, metrics = train_site_expert(cfg, site, library, device)
    return RecordDict({EXPERT_KEY: packed_weights(state), METRICS_KEY: MetricRecord({**metrics, "site-id": site.site_id})})


def site_scores(cfg: FactorySettings, site: SiteData, content: RecordDict, device: torch.device) -> RecordDict:
    """At a site: the class-level sums of the server's classifier on the site's validation split."""
    if CLASSIFIER_KEY not in content.array_records:
        raise UploadRejected("the validation query carries no classifier weights")
    # The model is built first: its size bounds the payload before anything is unpacked.
    model = run_classifier(cfg, tuple(site.train_images.shape[1:]), site.num_classes)
    state = unpacked_weights(content[CLASSIFIER_KEY], "the server's classifier", packed_size_limit(model.state_dict()))
    check_expert_weights(state, model.state_dict())
    model.load_state_dict(state)
    scores = class_scores(model, site.val_images, site.val_labels, site.num_classes, device)
    return RecordDict({SCORES_KEY: MetricRecord(scores.to_metrics())})
