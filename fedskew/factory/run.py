"""The settings both sides of FederatedFactory derive everything from, outside fedskew's own app: which
generators a site trains and with what seeds, how large an upload may be, which classifier the server and the
P2P experts train. A server and its sites must be given the same values."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fedskew.config import FactorySection, RunConfig


class FactoryRun(BaseModel):
    """The part of a run config FederatedFactory reads. It has the attributes of `RunConfig` that the functions
    of fedskew.factory read (`factory`, `seed`, `feature_side`, `method`), so they take either: fedskew's app passes
    its RunConfig, a Flower app of one's own builds this from the same arguments as its FederatedFactory strategy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    factory: FactorySection = Field(default_factory=FactorySection)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    p2p: bool = False  # the Product of Experts round follows the upload (method factory-p2p)
    feature_side: int = Field(RunConfig.model_fields["feature_side"].default, ge=0, le=4096)

    @property
    def method(self) -> Literal["factory", "factory-p2p"]:
        """The run-config method these settings run (fedskew.methods.method_of reads it)."""
        return "factory-p2p" if self.p2p else "factory"


# What the functions of fedskew.factory take: fedskew's RunConfig or the FactoryRun of an app of one's own.
FactorySettings = RunConfig | FactoryRun
