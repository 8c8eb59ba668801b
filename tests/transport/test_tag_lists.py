"""Notification lists (``pack_tags`` / ``unpack_tags``, spec/v1/tags.md): property tests."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from kvproto.transport.base import LIST_MAGIC, pack_tags, unpack_tags

TAGS = st.lists(st.binary(min_size=1, max_size=64), min_size=2, max_size=40)


@given(TAGS)
def test_tag_lists_round_trip(tags: list[bytes]) -> None:
    """Packing any 2+ non-empty tags and unpacking gives them back, in order."""
    data = pack_tags(tags)
    assert data[:2] == LIST_MAGIC and struct.unpack_from("<H", data, 4)[0] == len(tags)
    assert unpack_tags(data) == tags


@given(st.binary(max_size=200))
def test_tag_lists_unpack_never_raises(data: bytes) -> None:
    """Any bytes unpack to a list or to None (handed on as one tag), never to an exception; what
    unpacks packs back to the same bytes (one parse)."""
    tags = unpack_tags(data)
    if tags is not None:
        assert len(tags) >= 2 and pack_tags(tags) == data


@given(TAGS, st.data())
def test_tag_lists_a_cut_or_grown_list_does_not_unpack(tags: list[bytes], data: st.DataObject) -> None:
    """A well-formed list cut short, or with bytes after its last tag, is not a list."""
    packed = pack_tags(tags)
    cut = data.draw(st.integers(min_value=0, max_value=len(packed) - 1))
    assert unpack_tags(packed[:cut]) is None
    assert unpack_tags(packed + data.draw(st.binary(min_size=1, max_size=8))) is None
