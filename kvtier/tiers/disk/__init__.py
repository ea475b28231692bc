"""The disk tier: the file format (:mod:`.format`), the blocking file I/O run
on its thread pool (:mod:`.io`) and the tier itself (:mod:`.tier`).

Imports the tiers' base, budget and policy; never the core or metrics.
"""

from kvtier.tiers.disk.format import HEADER, CorruptBlock
from kvtier.tiers.disk.tier import DiskTier, FsyncPolicy

__all__ = ["HEADER", "CorruptBlock", "DiskTier", "FsyncPolicy"]
