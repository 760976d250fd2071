"""The stateful features a training run builds, in the order it builds and updates them
(a later one's build may trace the model with an earlier one's collections)."""

from fp4lab.features.delayed import AmaxHistories
from fp4lab.features.osci_reset import Oscillations
from fp4lab.features.outcontrol import OutlierChannels
from fp4lab.features.probes import Probes

__all__ = ["TRAINING"]

TRAINING = (AmaxHistories, Probes, OutlierChannels, Oscillations)
