"""docs/api.md's example app (examples/fednca-own-model): fedskew's FedNCA strategy in a ServerApp of the
user's own, with the user's own model and data loader, run through a real `flwr run` on two sites."""

import re
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fednca-own-model"
# Chance: the server's test set holds 512 images x 3 classes = 1536 decisions, each class present with
# probability 1/2, so a model blind to the images is right on 0.5 of them, give or take sqrt(0.25 / 1536) =
# 0.013 (one standard deviation). 0.6 is 8 of those above chance: a model that passes it has learned.
FLOOR = 0.6


def test_the_api_example_runs_through_flwr_run_and_learns(tiny_run_superlink):
    outcome = tiny_run_superlink.run_app({}, num_supernodes=2, app_dir=EXAMPLE, timeout=600)
    assert outcome.completed, outcome.output[-4000:]
    accuracy = float(re.search(r"final test label-accuracy: ([0-9.]+)", outcome.output).group(1))
    assert accuracy > FLOOR, outcome.output[-4000:]


def test_docs_api_shows_the_example_files_as_they_are():
    page = (EXAMPLE.parent.parent / "docs" / "api.md").read_text()
    for path in ("pyproject.toml", "fednca_own_model/task.py", "fednca_own_model/server_app.py",
                 "fednca_own_model/client_app.py"):  # fmt: skip
        text = (EXAMPLE / path).read_text()
        assert f"\n{text}```" in page, f"docs/api.md does not show examples/fednca-own-model/{path} as it is"
