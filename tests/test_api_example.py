"""docs/api.md's example apps, each run through a real `flwr run`: fedskew's FedNCA strategy in a ServerApp of
the user's own, with the user's own model and data loader, on two sites (examples/fednca-own-model); and
fedskew's FederatedFactory strategy with FederatedFactory's site functions on the user's own data, on three
sites of one class each (examples/factory-own-data)."""

import re
from pathlib import Path

import numpy as np
from pattern_data import learnt_floor

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


FACTORY_EXAMPLE = EXAMPLE.parent / "factory-own-data"
# The example's test set (task.test_set): 20 images of each of its 3 classes.
FACTORY_TEST_LABELS = np.repeat(np.arange(3), 20)


def test_the_factory_example_runs_through_flwr_run_and_learns_from_synthetic_images_alone(tiny_run_superlink):
    # Each site holds one class, so only the generators carry the others: an image-blind classifier is right on a
    # third of the test images; learnt_floor (halfway from there to 1, as in tests/test_user_paths.py) is 2/3.
    outcome = tiny_run_superlink.run_app({}, num_supernodes=3, app_dir=FACTORY_EXAMPLE, timeout=600)
    assert outcome.completed, outcome.output[-4000:]
    assert "classifier trained on 240 synthetic images" in outcome.output, outcome.output[-4000:]
    accuracy, floor = float(re.search(r"final test accuracy: ([0-9.]+)", outcome.output).group(1)), learnt_floor(FACTORY_TEST_LABELS)
    print(f"\nfactory example: test accuracy {accuracy:.3f}, floor {floor:.3f}")  # pytest -s shows it
    assert accuracy >= floor, outcome.output[-4000:]


def test_docs_api_shows_the_factory_example_apps_as_they_are():
    page = (EXAMPLE.parent.parent / "docs" / "api.md").read_text()
    for path in ("factory_own_data/server_app.py", "factory_own_data/client_app.py"):
        text = (FACTORY_EXAMPLE / path).read_text()
        assert f"\n{text}```" in page, f"docs/api.md does not show examples/factory-own-data/{path} as it is"
