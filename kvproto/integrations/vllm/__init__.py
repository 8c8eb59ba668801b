"""kvproto as a vLLM KV connector: one flag, no code.

Theory of operation
-------------------
vLLM loads out-of-tree KV connectors by module path. Both instances of a disaggregated pair
name this one::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVProtoConnector",
        "kv_connector_module_path": "kvproto.integrations.vllm",
        "kv_role": "kv_producer",                       # "kv_consumer" on the decode instance
        "kv_connector_extra_config": {"bootstrap_port": 17557}}'

kvproto is *push*: the prefill's workers write into the decode's blocks, the decode issues no
reads. Two proxy flows work:

* **sequential** (vLLM's usual proxy): the request goes to the prefill with ``do_remote_decode``;
  its finished output's ``kv_transfer_params`` (``kvproto_bootstrap``, ``kvproto_room``) go with
  the request to the decode, which opens the room on arrival and sends its blocks once allocated;
* **concurrent** (``examples/vllm_proxy.py``): the proxy picks the room id and sends the request to
  both at once (the prefill with ``kvproto_room``, the decode with the prefill's bootstrap address
  and that room); the decode's room is open before the prefill's forward, so each layer lands in
  the decode's blocks as the prefill computes it.

A request's life::

    prefill scheduler              prefill workers          decode scheduler             decode workers
    first scheduled: a room id ──► open the room            on arrival: Hold ─────────► open the room
    every step: the chunk's    ──► send each layer as its   blocks allocated: Recv ───► its destination
      whole pages (every group)    forward ends (event)     room ended ◄─────────────── finished_recving
    request_finished: hold the                                (FAILED: failed_recving, vLLM recomputes)
      blocks, return kv_transfer_params
    room ended ◄──────────────── finished_sending (blocks freed)

The modules: ``settings`` (``kv_connector_extra_config``, ports, the compatibility key, CURVE
keys), ``cache`` (vLLM's KV cache groups as kvproto groups), ``scheduler`` and ``worker`` (the two
roles), ``stats`` (vLLM's metrics), ``connector`` (the class vLLM loads).
"""

from kvproto.integrations.vllm.cache import GroupPlan, Unsupported, kv_cache_from_vllm, plan_groups
from kvproto.integrations.vllm.connector import KVProtoConnector
from kvproto.integrations.vllm.scheduler import Abort, Hold, KVProtoMetadata, Open, Recv, Send
from kvproto.integrations.vllm.settings import BOOTSTRAP, ERROR, ROOM, Settings, compat_key, curve_auth, model_id
from kvproto.integrations.vllm.stats import KVProtoPromMetrics, KVProtoStats

__all__ = ["Abort", "BOOTSTRAP", "ERROR", "GroupPlan", "Hold", "KVProtoConnector", "KVProtoMetadata",
           "KVProtoPromMetrics", "KVProtoStats", "Open", "ROOM", "Recv", "Send", "Settings", "Unsupported",
           "compat_key", "curve_auth", "kv_cache_from_vllm", "model_id", "plan_groups"]
