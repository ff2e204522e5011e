"""The kernel: durable processes behind one object (accounts, devices and routing come next)."""

from agentloop.kernel.kernel import Kernel, Process
from agentloop.process.api import Approval, Compacted, Receipt, RunActive, RunNotCurrent
from agentloop.process.signals import AccountSignal, Signal
from agentloop.process.store import NoSuchProcess, ProcessBusy

__all__ = [
    "AccountSignal",
    "Approval",
    "Compacted",
    "Kernel",
    "NoSuchProcess",
    "Process",
    "ProcessBusy",
    "Receipt",
    "RunActive",
    "RunNotCurrent",
    "Signal",
]
