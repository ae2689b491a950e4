"""Moved to tests/support/nccl_rules.py; this name stays until the tests other lanes are editing
import it from there (tests/unit/test_test_tools.py lists them)."""

from tests.support.nccl_rules import Deadlock, DeviceOp, FakeNetwork, replay

__all__ = ["Deadlock", "DeviceOp", "FakeNetwork", "replay"]
