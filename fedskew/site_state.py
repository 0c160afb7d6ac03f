"""Tensors a site keeps between rounds (SCAFFOLD's control variate, FedDyn's gradient state).

Flower 1.42 runs the ClientApp once per message, in a fresh process under a deployed SuperNode.
`context.state` still carries over: the SuperNode hands the stored context to each ClientApp
process and stores the context that process returns (and the simulation engine keeps every
node's context between messages). That copy lives in the SuperNode's memory, so a restarted
SuperNode forgets it; a site that gives node config `state-dir='/writable/path'` also gets the
state on disk (one file per run and name, written atomically) and a restarted SuperNode picks
it up again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context
from safetensors.torch import load_file, save_file

STATE_DIR_KEY = "state-dir"


class SiteStateError(ValueError):
    """The site's saved state is unusable; the message names the file or key."""


class SiteState:
    """get/put of named tensor dicts, in context.state and (with node config state-dir) on disk."""

    def __init__(self, context: Context):
        self.records = context.state
        state_dir = context.node_config.get(STATE_DIR_KEY)
        self.directory = Path(str(state_dir)).expanduser() / f"run-{context.run_id}" if state_dir else None
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SiteStateError(
                    f"node config {STATE_DIR_KEY} = {state_dir!r}: cannot create {self.directory} ({exc}); "
                    "give a writable directory"
                ) from exc

    def _file(self, name: str) -> Path:
        return self.directory / f"{name}.safetensors"

    def get(self, name: str) -> dict[str, torch.Tensor] | None:
        if name in self.records.array_records:
            return self.records.array_records[name].to_torch_state_dict()
        if self.directory is not None and self._file(name).is_file():
            try:
                return load_file(self._file(name))
            except Exception as exc:  # a truncated or foreign file: name it instead of a deep traceback
                raise SiteStateError(f"site state file {self._file(name)} is unreadable ({exc}); delete it to restart "
                                     "this site's state from zeros") from exc
        return None

    def put(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        self.records[name] = ArrayRecord(tensors)
        if self.directory is not None:
            partial = self._file(name).with_suffix(".partial")
            save_file(tensors, partial)
            os.replace(partial, self._file(name))
