"""etcd's v3 API as generated gRPC stubs: the messages and the service stubs.

The names of rpc_pb2 and rpc_pb2_grpc at the top, as etcd3's ``etcd3.etcdrpc``
has them (``rpc.TxnRequest``, ``rpc.KVStub``); ``kv_pb2`` (``mvccpb``, the
watch events) and ``auth_pb2`` are its submodules. Everything here but this
file and _pool.py is written by scripts/gen_etcd_stubs.py from the .proto
files beside it (README.md says where they come from).
"""

from .rpc_pb2 import *  # noqa: F403
from .rpc_pb2_grpc import *  # noqa: F403
