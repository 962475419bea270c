"""The descriptor pool that the generated modules here register etcd's API in.

Not protobuf's default pool: other etcd clients (etcd3, etcd3-fc,
etcd-sdk-python, aetcd) register the same messages (``etcdserverpb.RangeRequest``
and the rest) from their own copies of etcd's protos in the default pool, and
protobuf refuses a second definition of a name there ("duplicate symbol"), so
a process could not import both. scripts/gen_etcd_stubs.py points the modules
here. Nothing of the backend looks messages up by name in a pool.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
