"""Speculative decoding: proposers guess the next tokens, the target model checks them in one pass."""

from hasten.engine.spec.adaptive import DepthController
from hasten.engine.spec.ngram import NgramProposer
from hasten.engine.spec.verify import SpecStats, verify

__all__ = ["DepthController", "NgramProposer", "SpecStats", "verify"]
