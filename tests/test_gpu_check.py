"""bench/gpu_check.py --smoke: the GPU readiness script keeps working on a CPU-only CI machine."""

import json

import torch

from bench.gpu_check import main, steady_rate


def test_steady_rate_skips_the_warmup_steps():
    # steps end at 10 s (warm-up), then every 0.5 s: 3 steps of batch 8 in 1.5 s -> 16 img/s
    assert steady_rate([10.0, 10.5, 11.0, 11.5], warmup=0, per_step=8) == 16.0


def test_smoke_run_writes_every_measurement(tmp_path):
    threads = torch.get_num_threads()
    try:
        report = main(["--smoke", "--out", str(tmp_path / "check.json")])
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "check.json").read_text()) == json.loads(json.dumps(report))
    assert report["mode"] == "smoke" and report["skipped"] == []
    rows = {(r["batch"], r["precision"]) for r in report["edm2_training"]}
    assert rows == {(4, "fp32"), (4, "bf16"), (8, "fp32"), (8, "bf16")}
    assert all(r["images_per_s"] > 0 for r in report["edm2_training"])
    assert report["sampler"]["images_per_s"] > 0 and report["sampler"]["network_evaluations_per_image"] == 5
    assert report["fednca_resnet18"]["steps_per_s"] > 0
