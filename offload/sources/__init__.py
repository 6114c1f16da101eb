"""Weight sources: how a streamed block's bytes reach its device slot (see :mod:`.base`).

One source per file: :mod:`.pinned` (host images, pinned or bounce-buffered),
:mod:`.dlo` (rank shards: H2D of the shard, then all-gather), :mod:`.mmap`
(checkpoint mappings: copy plans, registration, direct copies, stager),
:mod:`.coded` (lossless coded images decoded on the copy side).
"""
