"""Tensor parallelism in one place: how tp_degree devices share out a model.

    sharding.py     which part of each declared weight a device holds (its `Shard` axis,
                    fused parts split part by part, KV heads replicated or padded)
    kv_sharding.py  how keys and values are shared out: `KVSharding`, decided once per model
                    from NeuronConfig.group_query_attention and shard_over_sequence
    replica.py      what one replica's program does with its part of a value (its own block,
                    an exchange of blocks, the cache slots it holds)

The pieces (blocks/) write programs from these decisions; the lowering sums ROW products
over the replicas; runtime/ only places one buffer per replica.
"""
