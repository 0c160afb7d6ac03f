"""The repository refers to nothing outside itself: no development-machine paths, no private planning files.

A user who clones the project has neither the files the developers worked from nor their machines'
directories, so a docstring, a page or a stored result that names them points at nothing.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What must never appear in a tracked text file, with the reason shown when it does.
FORBIDDEN = {
    r"shared/specs|\bspecs/[\w.-]+\.md|\b(?:edm2|fednca-ml|federated-factory|flower-1\.42-notes)\.md\b": (
        "a planning file outside the repository"
    ),
    r"(?<![\w.~-])/(?:work|root|home/[\w.-]+|Users/[\w.-]+)/": "an absolute path of a development machine",
    r"\bthe issue'?s?\b|\bissues? #?\d+\b": "a tracker issue users cannot see",
}
# Results and documentation must not name a temporary directory of the machine that produced them either.
TMP_FORBIDDEN_UNDER = ("bench/results/", "docs/", "README.md")
TMP_PATH = re.compile(r"(?<![\w.~-])/tmp/")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in names.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path == Path(__file__).resolve():
            continue
        head = path.read_bytes()[:8192]
        if b"\0" in head:  # binary (images, weights)
            continue
        files.append(path)
    return files


def find_references(files: list[Path], root: Path = ROOT) -> list[str]:
    hits = []
    for path in files:
        relative = path.relative_to(root).as_posix()
        patterns = dict(FORBIDDEN)
        if relative.startswith(TMP_FORBIDDEN_UNDER):
            patterns[TMP_PATH.pattern] = "a temporary path of the machine that wrote it"
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern, why in patterns.items():
                if re.search(pattern, line):
                    hits.append(f"{relative}:{number}: {why}: {line.strip()[:120]}")
    return hits


def test_no_tracked_file_refers_outside_the_repository():
    hits = find_references(tracked_text_files())
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


def test_the_scan_finds_each_kind_of_reference(tmp_path):
    # The patterns above must catch what they are for (and leave ordinary prose alone).
    (tmp_path / "bench/results/x").mkdir(parents=True)
    bad = {
        "a.py": '"""Written from shared/specs/edm2.md."""',
        "b.md": "see specs/fednca-ml.md",
        "b2.py": "# ramp-up as in edm2.md",
        "c.json": '{"source_run": "/work/main/bench/results/run"}',
        "d.md": "Against the issue's targets",
        "bench/results/x/e.json": '{"path": "/tmp/pytest-1/run"}',
        "f.txt": "cache under /home/alice/.cache",
    }
    fine = {"g.md": "issue a server certificate; ~/.flwr/config.toml; ./work/ ; see docs/fednca.md", "h.py": "x = '/tmp/'"}
    for name, text in {**bad, **fine}.items():
        (tmp_path / name).write_text(text + "\n")
    hits = find_references([tmp_path / name for name in {**bad, **fine}], root=tmp_path)
    assert sorted(hit.split(":")[0] for hit in hits) == sorted(bad)
