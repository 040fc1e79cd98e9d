"""Data in: the built-in sets and a user's ``.npz``, checked against the model, sharded per worker.

``split`` (the in-memory data set), ``dataset`` (built-in sets, sharding, the data position),
``npz`` and ``multi`` (a user's file, one input or several), ``arrays`` and ``fit`` (the rules
each array and the whole set must meet before the first step); ``shards``, ``rows`` and ``feed``
(data larger than memory, read in place a batch ahead); ``tfrecord``, ``example``, ``crc32c``,
``mapping``, ``parquet``, ``sources``, ``convert``, ``describe`` and ``cli`` (``ringtrain data
inspect|convert``, run once before training: TFRecord, Parquet, image folders and ``.npz`` into
the shards the trainer streams).
"""
