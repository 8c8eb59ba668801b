"""``kvproto.testing.reference`` (reference caches for the demo, the benches and the tests) under
its older name: the module is the same object, private names included."""

import sys

from kvproto.testing import reference as _reference

sys.modules[__name__] = _reference
