"""Flower transport for fedskew.factory.site_validation: the server's candidate classifier goes to
every site in a query message (its weights packed as for the generators), the site's class-level
sums come back as a MetricRecord."""

from __future__ import annotations

import torch
from flwr.app import Message, RecordDict

from fedskew.factory.site_validation import AskSites, ClassScores, pooled, select_and_calibrate
from fedskew.protocol import CLASSIFIER_KEY, SCORES_KEY, VALIDATION_MESSAGE, packed_weights
from fedskew.strategies.factory_flow import FactoryFlow


def scores_of(content: RecordDict, num_classes: int, val_size: int, source: str) -> ClassScores:
    """A site's validation scores, checked (`ClassScores.from_metrics`) and bounded by the `val_size` validation
    images it declared in its survey: more would let one site's claim outweigh every other site's real images
    in the pooled scores that choose the classifier and its calibration. ValueError naming `source` otherwise."""
    if SCORES_KEY not in content.metric_records:
        raise ValueError(f"{source}: the validation reply has no '{SCORES_KEY}' record")
    scores = ClassScores.from_metrics(dict(content[SCORES_KEY]), num_classes, source)
    if scores.counts.sum() > val_size:
        raise ValueError(f"{source}: the validation reply counts {scores.counts.sum():.0f} images; the site declared "
                         f"{val_size} validation images in its survey")
    return scores


def asking(flow: FactoryFlow, survey: dict[int, dict], num_classes: int) -> AskSites:
    """Sends weights to every site of `survey` and pools the replies that pass `scores_of` (one that does not is
    left out, recorded as dropped with the reason; fewer usable replies than min-available-sites end the run)."""

    def ask(state: dict[str, torch.Tensor]) -> ClassScores:
        messages = [
            Message(RecordDict({CLASSIFIER_KEY: packed_weights(state)}), dst_node_id=node, message_type=VALIDATION_MESSAGE)
            for node in sorted(survey)
        ]
        replies = []
        for reply in flow.exchange(1, messages):
            node = int(flow._site_of(reply))
            source = f"site {survey[node].get('site-id')} (node {node})"
            try:
                replies.append(scores_of(reply.content, num_classes, int(survey[node]["val-size"]), source))
            except ValueError as err:
                flow._refuse(1, str(node), f"left out of site validation: {err}")
        flow.require_floor(1, len(replies), "site-validation scores")
        return pooled(replies, num_classes)

    return ask


def validate_at_sites(
    flow: FactoryFlow, model: torch.nn.Module, checkpoints: dict[int, dict[str, torch.Tensor]], calibration_rounds: int
) -> tuple[torch.nn.Module, dict]:
    """`model` loaded with the checkpoint the real validation images of the flow's sites prefer, output biases
    calibrated on them (`calibration_rounds`: factory.calibration-rounds); and the report of what they measured."""
    num_classes = flow.task.num_classes
    state, report = select_and_calibrate(checkpoints, num_classes, asking(flow, flow.survey, num_classes), calibration_rounds)
    model.load_state_dict(state)
    print(
        f"site validation: epoch {report['chosen_epoch']} chosen, balanced accuracy on the sites' real "
        f"validation images {report['site_val_balanced_accuracy']:.4f}",
        flush=True,
    )
    return model, report
