"""The generator library: what a site uploads, how the server checks it, where it is kept, and the
class-balanced synthetic data drawn from it.

A module is one uploaded generator: an unconditional EDM2 model of one (site, class), or one
class-conditional model of a site. Uploads are untrusted input, so `validate_upload` checks every
declared fact against what the server derived for that site (`PlannedModule`: id, classes, image
counts, config) and the weights against the config (names, shapes, float32, finite values, checksum)
before anything is built from them, and rejects the whole upload with the first reason found; a
relayed or stored library is checked the same way by `validate_modules` (bounded types and ranges).

On disk (`library/`): `<module-id>.safetensors` + `<module-id>.json` per module (generator_io's
format) and `manifest.json` listing the modules with their metadata. The synthetic set is stored
as `synthetic.safetensors` with the sampling plan (module, class, count and seed of every draw) in
its header, so unlearning drops samples instead of regenerating them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file as load_numpy_file  # noqa: E402
from safetensors.numpy import save_file as save_numpy_file  # noqa: E402
from safetensors import SafetensorError, safe_open  # noqa: E402

from fedskew.config import FactorySection  # noqa: E402
from fedskew.models.edm2 import GeneratorConfig, Guidance, Precond, sample  # noqa: E402
from fedskew.progress import ProgressReporter  # noqa: E402
from fedskew.protocol import UploadRejected  # noqa: E402
from fedskew.factory.parallel import run_side_by_side, worker_count  # noqa: E402
from fedskew.models.generator_io import (  # noqa: E402
    GeneratorFileError,
    generator_from_arrays,
    load_generator,
    save_generator,
)

LIBRARY_FORMAT = "fedskew-factory-library"
LIBRARY_VERSION = 1
MANIFEST = "manifest.json"
SYNTHETIC_FILE = "synthetic.safetensors"
# A run with autoguidance (factory.guide-steps) keeps the guides as a library of their own, inside its library.
GUIDES_DIR = "guides"
# Module ids become file names: no separators, no leading dot, nothing after the last character
# (`\Z`, not `$`, which also matches before a trailing newline).
MODULE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
SHA256_HEX = re.compile(r"[0-9a-f]{64}\Z")
# Image counts weigh a shared class's quota (float64 arithmetic, exact below 2**53); no site holds more.
MAX_IMAGE_COUNT = 10**12
# Noise is drawn per chunk of this many images, so a synthetic set does not depend on the batch size.
NOISE_CHUNK = 256


@dataclass(frozen=True)
class GeneratorModule:
    module_id: str
    site_id: int
    classes: tuple[int, ...]
    image_counts: tuple[int, ...]
    config: GeneratorConfig
    checksum: str
    # Share of audit samples closer to a training image than a third of their distance to the
    # nearest held-out image (NaN: not audited).
    memorization: float
    state: dict[str, torch.Tensor] = dataclasses.field(repr=False, compare=False)
    # The DP-SGD guarantee (fedskew.factory.dp_sgd.generator_privacy: epsilon, delta, ...); None without DP.
    privacy: dict | None = None

    @property
    def conditional(self) -> bool:
        return self.config.label_dim > 0

    def metadata(self) -> dict:
        """Everything but the weights, JSON-able; `module_from_metadata` reads it back."""
        return {
            "module-id": self.module_id,
            "site-id": self.site_id,
            "classes": list(self.classes),
            "image-counts": list(self.image_counts),
            "config": self.config.to_dict(),
            "checksum": self.checksum,
            "memorization": self.memorization,
            **({"privacy": self.privacy} if self.privacy is not None else {}),
        }

    def model(self, device: torch.device | str = "cpu") -> Precond:
        return generator_from_arrays(self.config, self.state, self.checksum, device)


def module_id_for(site_id: int, class_id: int | None) -> str:
    """`site3-class7` for an unconditional (site, class) generator, `site3` for a conditional one."""
    return f"site{site_id}" if class_id is None else f"site{site_id}-class{class_id}"


# --- validation --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedModule:
    """A generator as the run config and a site's label counts determine it (factory.site.planned_modules):
    the site trains exactly these, and the server checks an upload against them, so a site cannot
    choose its module ids, classes, image counts or architecture; it supplies weights and its audit."""

    module_id: str
    classes: tuple[int, ...]
    image_counts: tuple[int, ...]
    config: GeneratorConfig
    privacy: dict | None = None

    @property
    def conditional(self) -> bool:
        return self.config.label_dim > 0


def _reject(module_id: str, problem: str) -> UploadRejected:
    return UploadRejected(f"module {module_id!r}: {problem}")


def _shown(value) -> str:
    """A received value for a message: its repr, cut short (a hostile one may be huge)."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _same_json(received, expected) -> bool:
    """Equal as JSON values, types included (1 is not 1.0 or true)."""
    return json.dumps(received, sort_keys=True) == json.dumps(expected, sort_keys=True)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value, name: str, module_id: str, low: int, high: int) -> list[int]:
    if not isinstance(value, list) or not value or not all(_is_int(v) and low <= v <= high for v in value):
        raise _reject(module_id, f"{name} must be a non-empty list of ints in {low}..{high}, got {_shown(value)}")
    return value


def _memorization(meta: dict, module_id: str, max_memorization: float) -> float:
    memorization = meta.get("memorization")
    if (
        not isinstance(memorization, (int, float))
        or isinstance(memorization, bool)
        or not (math.isnan(memorization) or 0 <= memorization <= 1)
    ):
        raise _reject(module_id, f"memorization must be a share in [0, 1] or NaN (not audited), got {_shown(memorization)}")
    if max_memorization > 0 and not memorization <= max_memorization:
        raise _reject(module_id, f"declared memorization {memorization} exceeds factory.max-memorization {max_memorization}")
    return float(memorization)


# Declared and derived epsilon may differ in the last digits when a site's numerical libraries are not the server's.
EPSILON_RTOL = 1e-6


def _privacy(meta: dict, module_id: str, max_epsilon: float, expected: dict | None | bool = False) -> dict | None:
    """The declared DP guarantee: absent, or an object with a finite epsilon >= 0; with max_epsilon > 0 it
    must be there and at most that. Given the `expected` one (derived from the run config; None: no DP),
    it must be that, epsilon up to EPSILON_RTOL, and the expected one is returned."""
    privacy = meta.get("privacy")
    epsilon = privacy.get("epsilon") if isinstance(privacy, dict) else None
    if privacy is not None and not (isinstance(epsilon, (int, float)) and not isinstance(epsilon, bool) and 0 <= epsilon < math.inf):
        raise _reject(module_id, f"privacy must be an object with a finite epsilon >= 0, got {_shown(privacy)}")
    if max_epsilon > 0 and privacy is None:
        raise _reject(module_id, f"declares no DP epsilon; factory.max-epsilon {max_epsilon} accepts only DP generators")
    if max_epsilon > 0 and epsilon > max_epsilon:
        raise _reject(module_id, f"declared DP epsilon {epsilon:.4g} exceeds factory.max-epsilon {max_epsilon}")
    if expected is False:
        return privacy
    matches = (privacy is None) == (expected is None) and (
        expected is None
        or (_same_json({**privacy, "epsilon": 0}, {**expected, "epsilon": 0})
            and math.isclose(epsilon, expected["epsilon"], rel_tol=EPSILON_RTOL))
    )  # fmt: skip
    if not matches:
        raise _reject(
            module_id, f"declared privacy {_shown(privacy)} differs from the server's, derived from the site's image "
            f"counts and the run config: {_shown(expected)}"
        )  # fmt: skip
    return expected


def _checked_weights(module_id: str, config: GeneratorConfig, meta: dict, state: dict[str, torch.Tensor]) -> str:
    """The declared checksum, after checking tensor names, shapes, dtypes, values and checksum."""
    checksum = meta.get("checksum")
    if not isinstance(checksum, str) or not SHA256_HEX.match(checksum):
        raise _reject(module_id, f"checksum must be a sha256 hex string (64 of 0-9a-f), got {_shown(checksum)}")
    try:
        generator_from_arrays(config, state, checksum, "meta")
    except GeneratorFileError as err:
        raise _reject(module_id, str(err)) from None
    return checksum


def _checked_module(
    meta: dict,
    state: dict[str, torch.Tensor],
    num_classes: int,
    image_shape: tuple[int, int, int],
    planned: Callable[[int, tuple[int, ...], tuple[int, ...]], PlannedModule] | None,
) -> GeneratorModule:
    """One module of a library (relayed to a site, or read from disk), every field checked."""
    module_id = meta["module-id"]
    site_id = meta.get("site-id")
    if not _is_int(site_id) or not 0 <= site_id < 2**31:
        raise _reject(module_id, f"site-id must be an int in 0..{2**31 - 1}, got {_shown(site_id)}")
    classes = _int_list(meta.get("classes"), "classes", module_id, 0, num_classes - 1)
    counts = _int_list(meta.get("image-counts"), "image-counts", module_id, 1, MAX_IMAGE_COUNT)
    if len(set(classes)) != len(classes) or len(counts) != len(classes):
        raise _reject(module_id, f"classes {classes} must be distinct, with one image count each (got {counts})")
    try:
        config = GeneratorConfig.from_dict(meta.get("config"))
    except (TypeError, ValueError) as err:
        raise _reject(module_id, f"invalid generator config: {err}") from None
    declared = (config.img_channels, config.img_resolution, config.img_resolution)
    if declared != tuple(image_shape):
        raise _reject(module_id, f"generator makes images {declared} (C, H, W) but the run's images are {tuple(image_shape)}")
    if config.label_dim not in (0, num_classes) or (config.label_dim == 0 and len(classes) != 1):
        raise _reject(
            module_id, f"label_dim {config.label_dim} with classes {classes}: valid are one class and label_dim 0 "
            f"(unconditional) or label_dim = the run's {num_classes} classes (conditional)"
        )  # fmt: skip
    expected_id = module_id_for(site_id, classes[0] if config.label_dim == 0 else None)
    if module_id != expected_id:
        raise _reject(module_id, f"a module of site {site_id} with classes {classes} is named {expected_id!r}")
    privacy = _privacy(meta, module_id, 0.0)
    if planned is not None:
        expected = planned(site_id, tuple(classes), tuple(counts))
        if config != expected.config:
            differing = [k for k, v in expected.config.to_dict().items() if config.to_dict()[k] != v]
            raise _reject(module_id, f"generator config fields {differing} differ from the run config's generator")
        privacy = _privacy(meta, module_id, 0.0, expected.privacy)
    memorization = _memorization(meta, module_id, 0.0)
    checksum = _checked_weights(module_id, config, meta, state)
    return GeneratorModule(module_id, site_id, tuple(classes), tuple(counts), config, checksum, memorization, state, privacy)


def validate_modules(
    metas: list,
    states: dict[str, dict[str, torch.Tensor]],
    *,
    num_classes: int,
    image_shape: tuple[int, int, int],
    planned: Callable[[int, tuple[int, ...], tuple[int, ...]], PlannedModule] | None = None,
) -> list[GeneratorModule]:
    """Every module of a library checked against its weights (`states`: module id -> weights); with
    `planned` (site id, classes, image counts -> the module the run config makes), each config must be
    the run's. UploadRejected names the first problem."""
    if not isinstance(metas, list) or not metas or not all(isinstance(m, dict) for m in metas):
        raise UploadRejected(f"modules must be a non-empty list of module metadata objects, got {_shown(metas)}")
    declared = [m.get("module-id") for m in metas]
    invalid = [d for d in declared if not isinstance(d, str) or not MODULE_ID.match(d)]
    if invalid:
        raise UploadRejected(
            f"module id {_shown(invalid[0])} is invalid; valid: a string of letters, digits, '_' and '-', at most 64"
        )
    if len(set(declared)) != len(declared):
        raise UploadRejected(f"module ids {_shown(declared)} are not distinct")
    if set(declared) != set(states):
        raise UploadRejected(f"metadata lists modules {_shown(sorted(declared))} but weights came for {_shown(sorted(states))}")
    return [_checked_module(m, states[m["module-id"]], num_classes, image_shape, planned) for m in metas]


def check_uploader(meta: dict, site_id: int) -> None:
    """The upload must be of the site its node is (`site_id`, from that node's own survey reply)."""
    if not isinstance(meta, dict):
        raise UploadRejected(f"upload metadata must be a JSON object, got {type(meta).__name__}")
    if not _same_json(meta.get("site-id"), site_id):
        raise UploadRejected(
            f"the upload claims site-id {_shown(meta.get('site-id'))}, but its node answered the survey as site "
            f"{site_id}; a node may upload only its own site's generators"
        )


# A withheld module's reason is one line of the site's audit; anything longer is not one.
WITHHELD_REASON_CHARS = 300


def withheld_modules(meta: dict, plan: Sequence[PlannedModule]) -> list[dict]:
    """The modules a site's upload says it withheld ({"module-id", "classes", "reason"}; the classes are the
    plan's): distinct module ids of its plan, each with a short reason. Withholding only removes what the
    server gets, so the reason is recorded, not verified; an upload that withholds every module is not one."""
    entries = meta.get("withheld", [])
    planned = {p.module_id: p for p in plan}
    if not isinstance(entries, list) or not all(isinstance(e, dict) and set(e) == {"module-id", "reason"} for e in entries):
        raise UploadRejected(f"withheld must be a list of {{'module-id', 'reason'}} objects, got {_shown(entries)}")
    ids = [e["module-id"] for e in entries]
    if not all(isinstance(i, str) and i in planned for i in ids) or len(set(ids)) != len(ids):
        raise UploadRejected(f"withheld names modules {_shown(ids)}; they must be distinct modules of this site's plan {list(planned)}")
    if not all(isinstance(e["reason"], str) and 0 < len(e["reason"]) <= WITHHELD_REASON_CHARS for e in entries):
        raise UploadRejected(f"each withheld module needs a reason of 1-{WITHHELD_REASON_CHARS} characters, got {_shown(entries)}")
    if plan and len(ids) == len(plan):
        raise UploadRejected("the upload withholds every module of the site; a site with nothing to upload refuses instead")
    return [{"module-id": e["module-id"], "classes": list(planned[e["module-id"]].classes), "reason": e["reason"]} for e in entries]


def validate_upload(
    meta: dict,
    states: dict[str, dict[str, torch.Tensor]],
    *,
    site_id: int,
    plan: Sequence[PlannedModule],
    image_shape: tuple[int, int, int],
    max_memorization: float = 0.0,
    max_epsilon: float = 0.0,
) -> list[GeneratorModule]:
    """One site's upload ({"site-id", "image-shape", "modules": [module metadata]}) checked against what
    the server derived for it: `site_id` is the one its node gave in its own survey reply, `plan` the
    modules its label counts and the run config make, less those it withheld (`withheld_modules`). The
    site supplies only weights, checksums and its memorisation audit; every other declared fact (its DP
    guarantee too) must equal the plan. With max_epsilon > 0 every module must declare a DP epsilon of at
    most that."""
    check_uploader(meta, site_id)
    withheld = {w["module-id"] for w in withheld_modules(meta, plan)}
    plan = [p for p in plan if p.module_id not in withheld]
    if not _same_json(meta.get("image-shape"), list(image_shape)):
        raise UploadRejected(f"the site's images are {_shown(meta.get('image-shape'))} (C, H, W); the run's are {list(image_shape)}")
    metas = meta.get("modules")
    expected_ids = [p.module_id for p in plan]
    if not isinstance(metas, list) or not all(isinstance(m, dict) for m in metas):
        raise UploadRejected(f"modules must be a list of module metadata objects, got {_shown(metas)}")
    declared = [m.get("module-id") for m in metas]
    if not _same_json(sorted(map(str, declared)), sorted(expected_ids)) or len(declared) != len(expected_ids):
        raise UploadRejected(
            f"the upload declares modules {_shown(declared)}; this site's survey label counts and the run config "
            f"make exactly {expected_ids}"
        )
    if sorted(states) != sorted(expected_ids):
        raise UploadRejected(f"weights came for modules {_shown(sorted(states))}; expected {expected_ids}")
    by_id = {m["module-id"]: m for m in metas}
    modules = []
    for planned in plan:
        module_meta, module_id = by_id[planned.module_id], planned.module_id
        server_facts = {"site-id": site_id, "classes": list(planned.classes), "image-counts": list(planned.image_counts),
                        "config": planned.config.to_dict()}  # fmt: skip
        for key, expected in server_facts.items():
            if not _same_json(module_meta.get(key), expected):
                raise _reject(
                    module_id, f"declared {key} {_shown(module_meta.get(key))} differs from the server's, derived from the "
                    f"site's survey and the run config: {_shown(expected)}"
                )  # fmt: skip
        privacy = _privacy(module_meta, module_id, max_epsilon, planned.privacy)
        memorization = _memorization(module_meta, module_id, max_memorization)
        checksum = _checked_weights(module_id, planned.config, module_meta, states[module_id])
        modules.append(
            GeneratorModule(
                module_id, site_id, planned.classes, planned.image_counts, planned.config, checksum, memorization,
                states[module_id], privacy,
            )
        )  # fmt: skip
    return modules


# --- the library ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Library:
    modules: tuple[GeneratorModule, ...]
    num_classes: int
    image_shape: tuple[int, int, int]
    class_names: tuple[str, ...]

    def covered_classes(self) -> list[int]:
        return sorted({c for m in self.modules for c in m.classes})

    def missing_classes(self) -> list[int]:
        return sorted(set(range(self.num_classes)) - set(self.covered_classes()))

    def module(self, module_id: str) -> GeneratorModule:
        for m in self.modules:
            if m.module_id == module_id:
                return m
        raise KeyError(f"no module {module_id!r}; the library holds {[m.module_id for m in self.modules]}")

    def without(self, module_ids: Iterable[str]) -> Library:
        drop = set(module_ids)
        unknown = drop - {m.module_id for m in self.modules}
        if unknown:
            raise KeyError(f"modules {sorted(unknown)} are not in the library")
        return dataclasses.replace(self, modules=tuple(m for m in self.modules if m.module_id not in drop))

    def manifest(self) -> dict:
        return {
            "format": LIBRARY_FORMAT,
            "version": LIBRARY_VERSION,
            "num-classes": self.num_classes,
            "image-shape": list(self.image_shape),
            "class-names": list(self.class_names),
            "missing-classes": self.missing_classes(),
            "modules": [m.metadata() for m in self.modules],
        }


def generators_privacy(library: Library, factory: FactorySection, p2p: bool) -> dict:
    """The run's DP guarantee from its DP-SGD generators: each image is in exactly one generator, so
    every upload, and the library, is (largest epsilon, largest delta)-DP for one training image. What
    else the run released from the sites' real images is listed beside it: the guarantee does not cover it."""
    guarantees = [m.privacy for m in library.modules]
    return {
        "mode": "dp-sgd-generators",
        "epsilon": max(g["epsilon"] for g in guarantees),
        "delta": max(g["delta"] for g in guarantees),
        "generators": len(guarantees),
        "accountant": guarantees[0]["accountant"],
        "unit": guarantees[0]["unit"],
        "not_covered": releases_outside_the_guarantee(factory, p2p),
    }


def releases_outside_the_guarantee(factory: FactorySection, p2p: bool) -> list[str]:
    """What a run with these settings (`p2p`: the Product of Experts round follows) sends from the sites' real
    images besides the DP generators."""
    released = ["the survey's image counts per class", "each generator's memorization share (its manifest entry)"]
    if p2p:
        released.append("each site's expert classifier, trained on its real images without DP")
    if factory.site_validation:
        released.append("each site's per-class sums of the server's classifier on its real validation images")
    if factory.match_intensity:
        released.append("each site's pixel histograms per class")
    return released


def write_library(library: Library, directory: Path) -> Path:
    """`directory/<module-id>.safetensors|.json` per module and `directory/manifest.json`."""
    directory.mkdir(parents=True, exist_ok=False)
    for module in library.modules:
        save_generator(module.model("cpu"), module.config, directory / module.module_id, extra_meta=module.metadata())
    path = directory / MANIFEST
    path.write_text(json.dumps(library.manifest(), indent=2) + "\n")
    return path


def read_library(directory: Path) -> Library:
    """Read and verify a library: every file's sha256 (generator_io) and every module as `validate_modules`
    checks it; GeneratorFileError or UploadRejected (both ValueErrors) name the file and the problem."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise GeneratorFileError(f"cannot read the library manifest {directory / MANIFEST}: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != LIBRARY_FORMAT or manifest.get("version") != LIBRARY_VERSION:
        raise GeneratorFileError(f"{directory / MANIFEST} is not a {LIBRARY_FORMAT} version {LIBRARY_VERSION} manifest")
    entries = manifest.get("modules")
    ids = [m.get("module-id") for m in entries if isinstance(m, dict)] if isinstance(entries, list) else []
    # Only ids that are plain file names are opened; validate_modules rejects the others by name.
    states = {i: dict(load_generator(directory / i)[0].state_dict()) for i in ids if isinstance(i, str) and MODULE_ID.match(i)}
    return library_from_manifest(manifest, states)


def library_from_manifest(
    manifest: dict,
    states: dict[str, dict[str, torch.Tensor]],
    planned: Callable[[int, tuple[int, ...], tuple[int, ...]], PlannedModule] | None = None,
) -> Library:
    """A library from its manifest and module weights (read from disk, or relayed to a site), every module
    validated (see `validate_modules`)."""
    if not isinstance(manifest, dict) or any(k not in manifest for k in ("num-classes", "image-shape", "class-names", "modules")):
        raise UploadRejected("a library manifest is an object with num-classes, image-shape, class-names and modules")
    num_classes, image_shape, names = manifest["num-classes"], manifest["image-shape"], manifest["class-names"]
    if not _is_int(num_classes) or not 1 <= num_classes <= 100_000:
        raise UploadRejected(f"library num-classes must be an int in 1..100000, got {_shown(num_classes)}")
    if not (isinstance(image_shape, list) and len(image_shape) == 3 and all(_is_int(v) and 1 <= v <= 4096 for v in image_shape)):
        raise UploadRejected(f"library image-shape must be three ints [C, H, W] in 1..4096, got {_shown(image_shape)}")
    if not (isinstance(names, list) and len(names) == num_classes and all(isinstance(n, str) for n in names)):
        raise UploadRejected(f"library class-names must be {num_classes} strings, got {_shown(names)}")
    modules = validate_modules(
        manifest["modules"], states, num_classes=num_classes, image_shape=tuple(image_shape), planned=planned
    )
    return Library(tuple(modules), num_classes, tuple(image_shape), tuple(names))


# --- class-balanced synthesis ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleJob:
    module_id: str
    class_id: int
    count: int
    seed: int


def split_quota(total: int, weights: Sequence[int]) -> list[int]:
    """Integers summing to `total`, proportional to `weights` (largest remainder; ties to the earlier)."""
    if total < 0 or not weights or min(weights) <= 0:
        raise ValueError(f"split_quota needs total >= 0 and positive weights, got total {total}, weights {list(weights)}")
    exact = np.asarray(weights, dtype=np.float64) * total / sum(weights)
    shares = np.floor(exact).astype(int)
    remainder_order = np.argsort(-(exact - shares), kind="stable")
    shares[remainder_order[: total - shares.sum()]] += 1
    return shares.tolist()


def capped_counts(counts: Sequence[int]) -> list[int]:
    """The weights a shared class's quota is split by: each holder's image count, capped at the other holders'
    total. The counts are what the sites declared in their survey, which the server cannot check: uncapped, a
    site claiming 10**12 images of a class took every synthetic image of it; capped, no claim takes more than
    half of a class another site also holds (nor does an honest site holding more than all the others
    together). A class with one holder is that holder's whole quota either way."""
    total = sum(counts)
    return list(counts) if len(counts) == 1 else [min(n, total - n) for n in counts]


def derived_seed(*parts: int) -> int:
    """A 31-bit seed determined by the integers `parts` (and by nothing else)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0] & 0x7FFFFFFF)


def job_seed(seed: int, module_id: str, class_id: int) -> int:
    """A draw's seed depends only on the run seed, module and class: dropping a module changes no other draw."""
    return derived_seed(seed, class_id, *module_id.encode())


def sampling_plan(library: Library, samples_per_class: int, seed: int, classes: Iterable[int] | None = None) -> list[SampleJob]:
    """`samples_per_class` images of every covered class (or of `classes`); a class held by several
    modules is split in proportion to the images each was trained on, each capped at the others' total
    (`capped_counts`)."""
    wanted = library.covered_classes() if classes is None else sorted(set(classes))
    jobs = []
    for class_id in wanted:
        holders = [(m, m.image_counts[m.classes.index(class_id)]) for m in library.modules if class_id in m.classes]
        if not holders:
            raise ValueError(f"class {class_id} has no generator in the library (covered: {library.covered_classes()})")
        for (module, _), count in zip(holders, split_quota(samples_per_class, capped_counts([n for _, n in holders]))):
            if count:
                jobs.append(SampleJob(module.module_id, class_id, count, job_seed(seed, module.module_id, class_id)))
    return jobs


@dataclass(frozen=True)
class SyntheticSet:
    images: np.ndarray  # (N, C, H, W) float32 in [0, 1]
    labels: np.ndarray  # (N,) int64
    source: np.ndarray  # (N,) int64 index into jobs: which draw made each image
    jobs: tuple[SampleJob, ...]

    def without_modules(self, module_ids: Iterable[str]) -> SyntheticSet:
        """The set minus every image drawn from those modules (the remaining images are unchanged)."""
        drop = set(module_ids)
        kept_jobs = [i for i, job in enumerate(self.jobs) if job.module_id not in drop]
        keep = np.isin(self.source, kept_jobs)
        renumber = np.full(len(self.jobs), -1, dtype=np.int64)
        renumber[kept_jobs] = np.arange(len(kept_jobs))
        return SyntheticSet(
            self.images[keep], self.labels[keep], renumber[self.source[keep]], tuple(self.jobs[i] for i in kept_jobs)
        )


def draw_module_images(
    module: GeneratorModule, jobs: Sequence[SampleJob], steps: int, batch_size: int, device: torch.device,
    guide: GeneratorModule | None = None, guidance_weight: float = 1.0,
) -> list[np.ndarray]:
    """The images of each of `jobs` (all draws from `module`, each of count >= 1 as `sampling_plan` makes
    them), in order. A draw's noise comes in chunks of NOISE_CHUNK images seeded from the draw's seed, so
    its images depend on neither batch_size nor the other draws. With a `guide` (a weaker generator of the
    same classes) the sampler follows guide + guidance_weight x (module - guide): autoguidance (Karras et
    al. 2024)."""
    model = module.model(device)
    guidance = Guidance(guide.model(device), guidance_weight) if guide is not None else None
    return [
        np.concatenate([
            sample(model, min(NOISE_CHUNK, job.count - start), labels=job.class_id if module.conditional else None, steps=steps,
                   seed=derived_seed(job.seed, chunk), batch_size=batch_size, device=device, guidance=guidance)
            for chunk, start in enumerate(range(0, job.count, NOISE_CHUNK))
        ])
        for job in jobs
    ]  # fmt: skip


def synthesise(
    library: Library,
    jobs: Sequence[SampleJob],
    *,
    steps: int,
    batch_size: int,
    device: torch.device,
    parallel: int = 1,
    progress: bool = True,
    guides: Library | None = None,
    guidance_weight: float = 1.0,
) -> SyntheticSet:
    """Run every draw of the plan on `device`, one module's draws per job of worker processes, as many as
    `parallel` (factory.parallel-generators; 0 = automatic) allows (fedskew.factory.parallel: the same images
    as one process at the same threads per module), with progress lines unless `progress` is False. With
    `guides`, each module is autoguided by the guide of its site and classes (`draw_module_images`)."""
    if not jobs:
        raise ValueError("the sampling plan is empty: the library covers no class")
    by_module: dict[str, list[int]] = {}
    for index, job in enumerate(jobs):
        by_module.setdefault(job.module_id, []).append(index)
    label = f"synthesising, autoguided at w = {guidance_weight:g}" if guides is not None else "synthesising"
    report = ProgressReporter(label, counted="image") if progress else None
    total, done = sum(j.count for j in jobs), 0

    def count_done(drawn: list[np.ndarray]) -> None:
        nonlocal done
        done += sum(len(images) for images in drawn)
        if report is not None:
            report(done, total)

    modules = [library.module(m) for m in by_module]
    work = [(module, [jobs[i] for i in indices], steps, batch_size, device, guide_of(module, guides), guidance_weight)
            for module, indices in zip(modules, by_module.values())]  # fmt: skip
    drawn = run_side_by_side(draw_module_images, work, worker_count(parallel, len(work), device), on_result=count_done)
    by_job = {i: job_images for indices, module_images in zip(by_module.values(), drawn) for i, job_images in zip(indices, module_images)}
    images = [by_job[i] for i in range(len(jobs))]
    labels = [np.full(job.count, job.class_id, dtype=np.int64) for job in jobs]
    source = [np.full(job.count, index, dtype=np.int64) for index, job in enumerate(jobs)]
    return SyntheticSet(np.concatenate(images), np.concatenate(labels), np.concatenate(source), tuple(jobs))


def guide_of(module: GeneratorModule, guides: Library | None) -> GeneratorModule | None:
    """The module of `guides` from the same site for the same classes (None without guides)."""
    if guides is None:
        return None
    for guide in guides.modules:
        if (guide.site_id, guide.classes) == (module.site_id, module.classes):
            return guide
    raise KeyError(f"no guide for {module.module_id} (site {module.site_id}, classes {list(module.classes)})")


def class_balanced_set(library: Library, factory: FactorySection, seed: int, device: torch.device,
                       guides: Library | None = None, guidance_weight: float = 1.0) -> SyntheticSet:
    """The server's training set: factory.samples-per-class images (by image side where it is 0) of every
    class the library covers (autoguided by `guides`, see `synthesise`)."""
    plan = sampling_plan(library, factory.server_samples_per_class(library.image_shape[-1]), seed)
    return synthesise(
        library, plan, steps=factory.sampler_steps, batch_size=factory.sample_batch_size, device=device,
        parallel=factory.parallel_generators, guides=guides, guidance_weight=guidance_weight,
    )  # fmt: skip


def save_synthetic(synthetic: SyntheticSet, path: Path) -> Path:
    plan = json.dumps([dataclasses.asdict(j) for j in synthetic.jobs])
    tensors = {"images": synthetic.images, "labels": synthetic.labels, "source": synthetic.source}
    save_numpy_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata={"jobs": plan})
    return path


def load_synthetic(path: Path) -> SyntheticSet:
    """The stored synthetic set; ValueError naming the file when it is not one `save_synthetic` wrote."""
    try:
        with safe_open(str(path), framework="numpy") as handle:
            jobs = tuple(SampleJob(**j) for j in json.loads((handle.metadata() or {})["jobs"]))
        arrays = load_numpy_file(str(path))
        images, labels, source = arrays["images"], arrays["labels"], arrays["source"]
    except (OSError, SafetensorError, ValueError, TypeError, KeyError, RecursionError) as err:
        raise ValueError(f"{path} is not a synthetic set written by fedskew ({type(err).__name__}: {err})") from None
    if len(images) != sum(j.count for j in jobs) or not len(labels) == len(source) == len(images) or source.max(initial=-1) >= len(jobs):
        raise ValueError(f"{path}: the stored images do not match the sampling plan in its header")
    return SyntheticSet(images, labels, source, jobs)


# --- sample grids -------------------------------------------------------------------------------------------


def tile(images: np.ndarray, columns: int) -> np.ndarray:
    """(N, C, H, W) in [0, 1] -> one (rows*(H+1), columns*(W+1)[, C]) image, 1 px gaps, short rows padded;
    images under 32 px are enlarged (nearest neighbour) so that a grid is readable."""
    scale = max(1, 32 // images.shape[-1])
    images = images.repeat(scale, axis=2).repeat(scale, axis=3)
    n, channels, height, width = images.shape
    rows = max(1, math.ceil(n / columns))
    padded = np.zeros((rows * columns, channels, height + 1, width + 1), dtype=np.float32)
    padded[:n, :, :height, :width] = images
    grid = padded.reshape(rows, columns, channels, height + 1, width + 1).transpose(0, 3, 1, 4, 2)
    grid = grid.reshape(rows * (height + 1), columns * (width + 1), channels)
    return grid[..., 0] if channels == 1 else grid


def save_class_grids(synthetic: SyntheticSet, directory: Path, per_class: int = 64) -> list[Path]:
    """`directory/class-<id>.png`: the first `per_class` synthetic images of each class present, and
    `directory/all-classes.png`: one row of 16 per class."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for class_id in np.unique(synthetic.labels):
        images = synthetic.images[synthetic.labels == class_id][:per_class]
        path = directory / f"class-{class_id}.png"
        plt.imsave(path, tile(images, columns=8), cmap="gray", vmin=0, vmax=1)
        paths.append(path)
    rows = [tile(synthetic.images[synthetic.labels == c][:16], columns=16) for c in np.unique(synthetic.labels)]
    plt.imsave(directory / "all-classes.png", np.concatenate(rows), cmap="gray", vmin=0, vmax=1)
    return paths
