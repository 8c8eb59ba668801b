"""kvproto-vmwrite passes kvproto's transport conformance suite."""

from kvproto.testing.conformance import TransportConformance


class TestVmWrite(TransportConformance):
    transport = "vmwrite"
