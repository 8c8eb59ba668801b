"""The kernel path: writes into a peer's GPU memory by one Triton kernel, over CUDA IPC.

Theory of operation
-------------------
Where prefill and decode share a machine, the decode rank's cache can be *mapped* into the
prefill process (CUDA IPC) and written by a kernel: one launch per write, whatever the number of
extents, instead of one transport descriptor per page (UCX charges microseconds for each). This
adapter does that for the peers it can map and hands every other peer, and every byte that is
not GPU memory, to a *fallback* adapter (``nixl`` by default), which also carries the tags. The
endpoints and cores do not know it exists: it is a ``Transport`` like the others.

What it guarantees (beyond ``kvproto.transport.base``):

* **Per-peer route, decided once at** ``add_peer``: a peer is *mapped* when its metadata comes
  from this host (same boot id) and every GPU region it registered can be opened here: its device
  is this process's device or one it has peer access to (``cuIpcOpenMemHandle`` with lazy peer
  access). A peer in this very process needs no mapping (its addresses are valid here; its regions on
  another GPU get peer access enabled, ``cuCtxEnablePeerAccess``). Anything
  else (another host, no CUDA, an allocation IPC cannot export) goes to the fallback, and the
  reason is logged. ``route(peer)`` tells which; the endpoints report it in ``room.stats`` and
  stop staging for mapped peers (staging exists to save descriptors, which a kernel does not pay).
* **Bounds before launch.** Every row and every pattern extent is checked against the memory
  this agent registered and the regions the peer's metadata listed; a kernel never runs on an
  address outside them (a stray write would corrupt another process silently).
* **One kernel per write.** ``post_plan`` moves tokens ``[start, end)`` as the geometry's
  ``PairPlan`` maps them, row by row, both addresses computed on the GPU from the two page lists
  (``kvproto.kernels.pattern.plan_rows``): head slices, block sizes and layouts convert in the
  kernel, and the host does no work per token. ``post_pattern`` moves given extents in every
  region pair; ``post_descs``/``post_prepared`` take rows, as for any adapter.
* **Writes of one pass go together.** A write of one rows launch under ``BATCH_BYTES`` (32 MiB)
  launches when the pass that posted it ends (the next ``poll``, ``drain_notifications`` or
  ``flush``), and consecutive such writes of one shape — the rooms of a forward, a layer's
  writes released by one event — go as one kernel, each its own pages and token range
  (``kvproto.transport.cuda_ipc.writes``). Each launch has its own event, so a room still ends
  with its own kernel, and launch order stays posting order.
* **Writes queued behind the engine.** ``wait_on_device(peer, events)`` makes the peer's next
  write wait on the lane for the engine's CUDA events (``cuStreamWaitEvent``), so a prefill
  endpoint posts a layer's writes while the layer still computes (a layer-wise send's ``ready``)
  and their kernel runs the moment it is done, with no host step between; writes that wait for
  the same events still go as one kernel. While such a write waits, every later launch of this
  agent's lane waits too (one stream, launch order), and removing its peer waits for it.
* **Tags after bytes.** A kernel write runs on this agent's own CUDA stream (after the work
  already queued on the caller's current stream) and records an event; that stream is a
  ``kvproto.kernels.lane.Lane``, which makes those calls and the table's upload on the driver
  (in the transfer bench on an H100 host a write's ``_run`` took 65-90 us that way, about 190 us
  through torch). Kernels finish in launch
  order, so one event query per pass finds every finished write (``_advance``); each write's tag
  then leaves, in order per peer, over the peer's tag channel (``kvproto.transport.local``: a
  local datagram that also wakes the peer's event loop), or through the fallback's ``notify``
  where that channel cannot reach it. So a tag leaves only once every byte is in the peer's
  memory, and tags to one peer keep their order.
* **Release.** ``remove_peer`` waits for this agent's kernels into that peer (its own stream:
  they always finish), then closes the mappings; writes to it poll ERROR and send no tag. A peer
  that dies keeps its memory alive for as long as it is mapped here (``docs/adapters.md``).

The binding is NVIDIA's ``cuda-bindings`` (``cuda.bindings.driver``; ``pip install
'kvproto[cuda-ipc]'``): the driver API's own, versioned Python binding, where IPC calls are
public and documented. PyTorch's IPC helpers are private (``torch.multiprocessing`` internals)
and may change with any release. Without ``cuda-bindings`` or a GPU, every peer takes the
fallback. The handles travel in this agent's metadata, i.e. in the decode rank's REGISTER, which
the control plane authenticates (CURVE, where on): an unauthenticated peer never receives them.

``cpu_kernels=True`` (tests) runs the kernel path on DRAM too, for peers in this process, with
Triton's interpreter, so that CPU-only CI checks this adapter's logic.

Where each part lives: ``adapter`` is the ``Transport`` (routes, mapping, registration and
metadata on the adapter kit, the writes' entry points, running a write's launches on the lane,
completions and tags); ``planner`` checks and plans a write's launches once per link and shape
(region bases, rows shapes, a state slot's plan: what does not depend on the pages);
``launches`` is a planned write (``PreparedParts`` and its recipes) and what it checks per write
(page lists, slot numbers); ``writes`` runs posted writes (waiting for their pass, launched alone
or batched, finished in launch order, their tags sent).
"""

from kvproto.transport.cuda_ipc.adapter import CudaIpcTransport, KernelXfer
from kvproto.transport.cuda_ipc.launches import PreparedParts, part_values

__all__ = ["CudaIpcTransport", "KernelXfer", "PreparedParts", "part_values"]
