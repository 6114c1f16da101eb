"""Weight sources: how a streamed block's bytes reach its device slot (see :mod:`.base`).

One transport per file: :mod:`.pinned` (host images, pinned or bounce-buffered; coded
images of :class:`~..host.images.BlockImages`), :mod:`.dlo` (rank shards: H2D of the shard,
then all-gather), :mod:`.mmap` (checkpoint mappings: copy plans, registration, direct copies,
stager; coded blocks from a mapping or a coded sidecar). A coded transport composes the one
decode stage, :mod:`.decode`.
"""
