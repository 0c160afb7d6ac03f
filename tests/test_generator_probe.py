import json

import numpy as np
from PIL import Image

from bench.generator_probe import flat_colours, main
from fedskew.factory.library import tile


def test_flat_control_is_one_colour_per_image():
    images = flat_colours(5, 8, seed=0)
    assert images.shape == (5, 3, 8, 8) and images.dtype == np.float32
    assert np.array_equal(images.max(axis=(2, 3)), images.min(axis=(2, 3))) and len(np.unique(images[:, 0, 0, 0])) == 5


def test_tile_lays_images_out_in_rows_with_one_pixel_gaps_enlarged_to_32_px():
    images = np.zeros((16, 1, 4, 4), dtype=np.float32)
    images[9] = 1.0  # second row, second column
    grid = tile(images, columns=8)
    cell = 4 * 8 + 1  # 4 px enlarged 8x to 32 px, plus the gap
    assert grid.shape == (2 * cell, 8 * cell)
    assert grid[cell:cell + 32, cell:cell + 32].min() == 1.0 and grid.sum() == 32 * 32


def test_probe_writes_a_grid_and_the_class_fd_beside_its_floor(tmp_path):
    main(["--dataset", "digits", "--image-size", "8", "--class-id", "3", "--steps", "2", "--channels", "8",
          "--out", str(tmp_path)])
    [record] = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert record["steps"] == 2 and record["channels"] == 8 and record["train_seconds"] > 0
    # Two steps of training draw noise: further from the class's test images than real training images are.
    assert record["fd"] > record["fd_floor"] >= 0
    grid = Image.open(tmp_path / "digits-8px-class3-2steps-8ch.png")
    cell = 8 * 4 + 1  # 8 px enlarged to 32, plus the gap
    assert grid.size == (2 * 8 * cell, 8 * cell)  # synthetic and real side by side, 8 x 8 images each


def test_each_p_mean_trains_its_own_generator_and_is_recorded(tmp_path):
    main(["--dataset", "digits", "--image-size", "8", "--class-id", "3", "--steps", "2", "--channels", "8",
          "--p-mean=-1.2,0.4", "--out", str(tmp_path)])
    records = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert [r["P_mean"] for r in records] == [-1.2, 0.4]
    assert [r["probe"] for r in records] == ["digits-8px-class3-2steps-8ch-pmean-1.2", "digits-8px-class3-2steps-8ch-pmean0.4"]
    assert all((tmp_path / f"{r['probe']}.png").is_file() for r in records)
    # Other noise levels give other gradients from the same seed, so other generators and samples.
    assert records[0]["fd"] != records[1]["fd"]
