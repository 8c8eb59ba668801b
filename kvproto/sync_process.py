"""``kvproto.sync.process`` (the synchronous facade's process face) under its older name.

The module is the same object: ``kvproto.sync_process.ProcessDecode`` is
``kvproto.sync.process.ProcessDecode``, private names included.
"""

import sys

from kvproto.sync import process as _process

sys.modules[__name__] = _process
