"""offload/sources/base.py: every source implements the one declared WeightSource interface
(the members the executor, streamed.py and the planners call, with the Protocol's signatures)."""
from __future__ import annotations

import inspect

import pytest

from weightstream.offload.sources.base import WeightSource
from weightstream.offload.sources.dlo import ShardSource
from weightstream.offload.sources.mmap import MmapCodedSource, MmapSource
from weightstream.offload.sources.pinned import CodedSource, PinnedSource

SOURCES = [PinnedSource, CodedSource, ShardSource, MmapSource, MmapCodedSource]
# what plan/coding.py, streamed.py and the DLO guard read off a source besides the ring members
READ_BY_PLANNERS = ("raw", "capacity", "codec", "coding_active", "decode_at", "decode_stream", "ncoll",
                    "sample", "coded_shard_bytes", "code_blocks", "ready_to_gather", "local_piece", "link_bytes")


def _methods(cls) -> dict:
    return {name: member for name, member in vars(cls).items()
            if inspect.isfunction(member) and not name.startswith("_")}


def test_the_protocol_declares_what_the_planners_read():
    for name in READ_BY_PLANNERS:
        assert hasattr(WeightSource, name), f"WeightSource does not declare {name!r}"


@pytest.mark.parametrize("cls", SOURCES, ids=lambda c: c.__name__)
def test_every_source_subclasses_the_protocol_with_its_signatures(cls):
    assert WeightSource in cls.__mro__
    declared = _methods(WeightSource)
    for klass in cls.__mro__:
        if klass is WeightSource or WeightSource not in klass.__mro__:
            continue
        for name, member in _methods(klass).items():
            if name not in declared:
                continue
            want = list(inspect.signature(declared[name]).parameters)
            got = list(inspect.signature(member).parameters)
            assert got == want, f"{klass.__name__}.{name}{got} differs from WeightSource.{name}{want}"
