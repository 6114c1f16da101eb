"""Triton bodies for `weightstream.kernels.codec` (private).

One launch decodes any number of coded tensors: the grid is the total number
of TILE-element tiles over all segments of a `DecodeTable`, and each program

1. binary-searches the table's tile prefix sums for its segment (tensor),
2. reads the segment's record (see `codec_format._pack_records` for the fields),
3. loads its tile's raw bytes and code bit planes (contiguous bytes),
4. marks escapes, ranks them with a prefix sum plus the tile's stored base,
   and reads their symbols from the exception stream; other codes index the
   tensor's table (k = 8: the code is the symbol). Version-2 tensors (k2 > 0;
   that code is compiled only when the table holds one, LEVEL2) read each
   escape's k2-bit level-2 code at bit rank * k2 of the level-2 code stream,
   rank the level-2 escapes with a second prefix sum plus the tile's level-2
   base and read those from the exception stream (`_level2`),
5. joins symbol and raw byte into the 16-bit element and stores it (float8 tensors, split 2:
   the symbol is the element, stored as a byte through `dst8_ptr`, a uint8 view of the same
   destination; their raw stream is empty and never read; compiled only when the table holds
   one, BYTES).
6. Version-3 tensors (record field 13 >= 0; that code is compiled only when the
   table holds one, PATCHED) skip 4's ranks and loads: an escape is stored with
   whatever its code gives, then, after a barrier, the tile's patch list (its
   range from the base stream) rewrites those elements (`_patch`). A table with
   no tensor that ranks escapes (only version 3 and k in {0, 8}: what codec
   "exp-kp" writes) compiles without step 4 at all (RANKED False): fewer
   registers, more programs resident.

Full tiles whose level-1 table is a window (record field 12 >= 0, `codec_format._word_window`)
run steps 3-5 on uint32 words of four elements instead (`_decode_tile_words`, WORDS).

Payload is handled as integers only, so decoding is exact on raw bits.
Offsets are rebuilt as `(x // A) * A` where A is a known alignment, so the
compiler can prove alignment and issue vector loads and stores.
"""
import triton
import triton.language as tl

# int64 fields per segment record; must match `codec_format._pack_records`.
_NUM_FIELDS = tl.constexpr(14)
_PATCH = tl.constexpr(256)  # patches one pass of a tile's patch loop rewrites


@triton.jit
def _plane(src_ptr, tile_code, k, W: tl.constexpr, TILE: tl.constexpr, GATHER: tl.constexpr):
    """The code bits held by bit plane W of a tile, shifted to their place ([TILE] int32).

    GATHER: every element loads its own plane byte (addresses repeat 8 / W
    times, served by L1) instead of loading each byte once and reshaping
    [8 / W, SPAN] -> [TILE] (which may go through shared memory)."""
    # PER = 8 // W elements per byte, SPAN = TILE * W // 8 bytes (inline: constexpr arithmetic)
    if GATHER:
        out = _plane_at(src_ptr, tile_code, k, W, TILE, tl.arange(0, TILE))
    else:
        start = tile_code + (TILE // 8) * (k & ~(2 * W - 1))  # wider planes come first
        start = (start // 16) * 16
        j = tl.arange(0, TILE * W // 8)
        present = (j * 0 + (k & W)) != 0  # a vector: the interpreter cannot AND a scalar bool into a mask
        byte = tl.load(src_ptr + start + j, mask=present, other=0).to(tl.int32)
        slot = tl.arange(0, 8 // W)
        bits = (byte[None, :] >> (W * slot[:, None])) & ((1 << W) - 1)
        bits = tl.reshape(bits, [TILE])  # element slot * SPAN + j
        out = bits << (k & (W - 1)).to(tl.int32)
    return out


@triton.jit
def _plane_at(src_ptr, tile_code, k, W: tl.constexpr, TILE: tl.constexpr, offs):
    """Plane W's code bits of the tile's elements `offs` (in-tile indices, any subset), shifted to
    their place: each element loads its own plane byte (repeated addresses are served by L1)."""
    start = tile_code + (TILE // 8) * (k & ~(2 * W - 1))  # wider planes come first
    start = (start // 16) * 16
    present = (offs * 0 + (k & W)) != 0
    byte = tl.load(src_ptr + start + offs % (TILE * W // 8), mask=present, other=0).to(tl.int32)
    bits = (byte >> (W * (offs // (TILE * W // 8)))) & ((1 << W) - 1)
    return bits << (k & (W - 1)).to(tl.int32)


@triton.jit
def _tile_base(src_ptr, base_abs, t):
    """Entry t of an int64 (little-endian) base stream: one scalar load. Streams are 16-byte aligned
    from the buffer's start: only for a src that starts 8-byte aligned (the word path's launches)."""
    return tl.load((src_ptr + base_abs + 8 * t).to(tl.pointer_type(tl.int64)))


@triton.jit
def _tile_base_bytes(src_ptr, base_abs, t, present):
    """Entry t of an int64 (little-endian) base stream from its 8 bytes: any src alignment.
    `present` (scalar bool): whether the stream exists (0 where it does not)."""
    b8 = tl.arange(0, 8)
    base_bytes = tl.load(src_ptr + base_abs + 8 * t + b8, mask=(b8 * 0 + present.to(tl.int32)) != 0, other=0)
    return tl.sum(base_bytes.to(tl.int64) << (8 * b8).to(tl.int64), axis=0)


@triton.jit
def _level2(src_ptr, rec, is_esc, esc_index, k, k2, first2):
    """Version 2: the symbols of a chunk's level-1 escapes ([CHUNK] int32, 0 elsewhere) and the
    chunk's count of level-2 escapes.

    `esc_index`: each escape's index in the tensor's escape order; its level-2 code is the
    k2 bits at bit esc_index * k2 of the level-2 code stream (read as two bytes: the stream
    has one byte of padding past its last code). Code 2^k2 - 1 escapes again: the symbol is
    the next level-2 exception byte (ranked by a prefix sum plus `first2`, the chunk's first
    level-2 exception index: the tile's level-2 base plus those of its earlier chunks);
    other codes index the level-2 table (after the 2^k - 1 level-1 entries)."""
    exc_abs = tl.load(rec + 3)
    table_abs = tl.load(rec + 4)
    code2_abs = tl.load(rec + 10)
    bit = tl.where(is_esc, esc_index, 0) * k2  # >= 0 on every lane: no negative shift where nothing escapes
    at = src_ptr + code2_abs + bit // 8
    lo = tl.load(at, mask=is_esc, other=0).to(tl.int32)
    hi = tl.load(at + 1, mask=is_esc, other=0).to(tl.int32)
    code2 = ((lo | (hi << 8)) >> (bit % 8).to(tl.int32)) & ((1 << k2) - 1).to(tl.int32)
    is_esc2 = is_esc & (code2 == ((1 << k2) - 1).to(tl.int32))
    rank2 = tl.cumsum(is_esc2.to(tl.int32), axis=0)
    exc = tl.load(src_ptr + exc_abs + first2 + rank2 - 1, mask=is_esc2, other=0).to(tl.int32)
    tab = tl.load(src_ptr + table_abs + ((1 << k) - 1) + code2, mask=is_esc & (~is_esc2), other=0).to(tl.int32)
    return tl.where(is_esc2, exc, tab), tl.sum(is_esc2.to(tl.int32), axis=0)


@triton.jit
def _patch(src_ptr, dst_ptr, dst8_ptr, raw_abs, base_abs, pos_abs, sym_abs, dst_elem, split, t,
           TILE: tl.constexpr, DST_ALIGN: tl.constexpr, BYTES: tl.constexpr):
    """Version 3: rewrite the tile's escaped elements from its patch list (entries base[t] to
    base[t + 1]: a uint16 position in the tile and the symbol; the raw byte is re-read). The
    barrier orders these stores after the tile's own (same program, same addresses). Byte
    loads only: any src alignment."""
    n0 = _tile_base_bytes(src_ptr, base_abs, t, t >= 0)
    n1 = _tile_base_bytes(src_ptr, base_abs, t + 1, t >= 0)
    if n1 > n0:
        tl.debug_barrier()
        for i in range(n0, n1, _PATCH):
            j = i + tl.arange(0, _PATCH)
            m = j < n1
            lo = tl.load(src_ptr + pos_abs + 2 * j, mask=m, other=0).to(tl.int32)
            hi = tl.load(src_ptr + pos_abs + 2 * j + 1, mask=m, other=0).to(tl.int32)
            p = lo | (hi << 8)
            sym = tl.load(src_ptr + sym_abs + j, mask=m, other=0).to(tl.int32)
            if BYTES:
                m16 = m & ((p * 0 + split) != 2)  # 8-bit elements have no raw stream
            else:
                m16 = m
            raw = tl.load(src_ptr + (raw_abs // 16) * 16 + t * TILE + p, mask=m16, other=0).to(tl.int32)
            bf16 = ((raw & 0x80) << 8) | (sym << 7) | (raw & 0x7F)
            val = tl.where((p * 0 + split) == 0, bf16, (sym << 8) | raw).to(tl.int16)
            tl.store(dst_ptr + (dst_elem // DST_ALIGN) * DST_ALIGN + t * TILE + p, val, mask=m16)
            if BYTES:
                tl.store(dst8_ptr + (dst_elem // DST_ALIGN) * DST_ALIGN + t * TILE + p, sym.to(tl.uint8),
                         mask=m & ((p * 0 + split) == 2))


@triton.jit
def _decode_tile(
    src_ptr, dst_ptr, dst8_ptr, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, numel, k, split, t, rec,
    TILE: tl.constexpr, DST_ALIGN: tl.constexpr, MASKED: tl.constexpr, GATHER: tl.constexpr,
    LEVEL2: tl.constexpr, PATCHED: tl.constexpr, RANKED: tl.constexpr, CHUNK: tl.constexpr, BYTES: tl.constexpr,
):
    """One tile element by element, CHUNK elements at a time (fewer live registers: the kernel's
    word path, compiled beside this one, runs at the occupancy the larger of the two allows).
    Escape ranks carry from chunk to chunk. CHUNK < TILE needs GATHER (planes by element)."""
    e0 = t * TILE
    tile_code = code_abs + t * (TILE // 8) * k
    if PATCHED:
        patch_sym = tl.load(rec + 13)
    if RANKED:
        # this tile's first exception index: an int64 (little-endian) of the base stream
        base = _tile_base_bytes(src_ptr, base_abs, t, k < 8)
        carry = base * 0  # escapes in the tile's earlier chunks
        if LEVEL2:  # compiled only for tables holding version-2 tensors: its code slows version-1 decode
            k2 = tl.load(rec + 9)  # level-2 code bits (0: one level)
            first2 = _tile_base_bytes(src_ptr, tl.load(rec + 11), t, k2 > 0)  # the element path: any alignment
    for c in range(TILE // CHUNK):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        mask = offs < numel - e0
        raw_ptr = src_ptr + (raw_abs // 16) * 16 + e0 + offs
        if BYTES:  # 8-bit elements (split 2) have no raw stream: nothing is read for them
            raw = tl.load(raw_ptr, mask=mask & ((offs * 0 + split) != 2), other=0).to(tl.int32)
        elif MASKED:
            raw = tl.load(raw_ptr, mask=mask, other=0).to(tl.int32)
        else:
            raw = tl.load(raw_ptr).to(tl.int32)
        if CHUNK == TILE:
            code = _plane(src_ptr, tile_code, k, 8, TILE, GATHER)
            code |= _plane(src_ptr, tile_code, k, 4, TILE, GATHER)
            code |= _plane(src_ptr, tile_code, k, 2, TILE, GATHER)
            code |= _plane(src_ptr, tile_code, k, 1, TILE, GATHER)
        else:
            code = _plane_at(src_ptr, tile_code, k, 8, TILE, offs)
            code |= _plane_at(src_ptr, tile_code, k, 4, TILE, offs)
            code |= _plane_at(src_ptr, tile_code, k, 2, TILE, offs)
            code |= _plane_at(src_ptr, tile_code, k, 1, TILE, offs)

        kv = offs.to(tl.int64) * 0 + k  # per-lane copies: masks are built from vectors only
        has_table = kv < 8
        if RANKED:
            escapes = (kv >= 1) & has_table
            is_esc = (code == ((1 << k) - 1).to(tl.int32)) & escapes & mask
            if PATCHED:  # version 3: no exception loads here (the patch loop below writes escapes)
                is_esc = is_esc & ((kv * 0 + patch_sym) < 0)
            index = base + carry + tl.cumsum(is_esc.to(tl.int32), axis=0) - 1  # each escape's exception index
            if LEVEL2:
                if k2 > 0:
                    exc, n2 = _level2(src_ptr, rec, is_esc, index, k, k2, first2)
                else:
                    exc = tl.load(src_ptr + exc_abs + index, mask=is_esc, other=0).to(tl.int32)
                    n2 = tl.sum(is_esc.to(tl.int32), axis=0) * 0
                first2 += n2
            else:
                exc = tl.load(src_ptr + exc_abs + index, mask=is_esc, other=0).to(tl.int32)
            carry += tl.sum(is_esc.to(tl.int32), axis=0)
            tab = tl.load(src_ptr + table_abs + code, mask=(~is_esc) & has_table & mask, other=0).to(tl.int32)
            sym = tl.where(has_table, tl.where(is_esc, exc, tab), code)
        else:  # no ranked escapes in this table: an escape code reads the table's padding, patched below
            tab = tl.load(src_ptr + table_abs + code, mask=has_table & mask, other=0).to(tl.int32)
            sym = tl.where(has_table, tab, code)

        bf16 = ((raw & 0x80) << 8) | (sym << 7) | (raw & 0x7F)
        high = (sym << 8) | raw
        val = tl.where((kv * 0 + split) == 0, bf16, high).to(tl.int16)
        dst = dst_ptr + (dst_elem // DST_ALIGN) * DST_ALIGN + e0 + offs
        if BYTES:
            byte = (kv * 0 + split) == 2
            tl.store(dst, val, mask=mask & (~byte))
            tl.store(dst8_ptr + (dst_elem // DST_ALIGN) * DST_ALIGN + e0 + offs, sym.to(tl.uint8), mask=mask & byte)
        elif MASKED:
            tl.store(dst, val, mask=mask)
        else:
            tl.store(dst, val)
    if PATCHED:
        if patch_sym >= 0:
            _patch(src_ptr, dst_ptr, dst8_ptr, raw_abs, base_abs, exc_abs, patch_sym, dst_elem, split, t, TILE,
                   DST_ALIGN, BYTES)


@triton.jit
def _plane_words(src_ptr, tile_code, K: tl.constexpr, W: tl.constexpr, TILE: tl.constexpr):
    """Plane W's code bits of a tile, four elements per uint32 word (byte b of word i: element 4 i + b),
    shifted to their place in each byte ([TILE // 4] uint32)."""
    NW: tl.constexpr = TILE // 4
    SPAN_W: tl.constexpr = TILE * W // 32  # words per plane
    wi = tl.arange(0, NW)
    start = tile_code + (TILE // 8) * (K & ~(2 * W - 1))
    start = (start // 16) * 16
    word = tl.load((src_ptr + start).to(tl.pointer_type(tl.uint32)) + wi % SPAN_W)
    keep: tl.constexpr = ((1 << W) - 1) * 0x01010101
    bits = (word >> (W * (wi // SPAN_W)).to(tl.uint32)) & keep
    return bits << (K & (W - 1))


@triton.jit
def _spread(x, HIGH: tl.constexpr):
    """Bytes 0, 1 (HIGH: 2, 3) of each uint32 word into the low bytes of its two 16-bit halves."""
    if HIGH:
        return ((x >> 16) & 0xFF) | ((x >> 8) & 0xFF0000)
    return (x & 0xFF) | ((x << 8) & 0xFF0000)


@triton.jit
def _join16(raw, sym, split, HIGH: tl.constexpr):
    """Two 16-bit elements per uint32 word from four-per-word raw and symbol bytes."""
    r = _spread(raw, HIGH)
    s = _spread(sym, HIGH)
    bf16 = ((r << 8) & 0x80008000) | (s << 7) | (r & 0x007F007F)
    return tl.where(split == 0, bf16, (s << 8) | r)


@triton.jit
def _word_bytes(src_ptr, first, rank, cnt):
    """Per word, the `cnt` (<= 4) bytes of a byte stream from `first + rank` on, in order, as one
    uint32 (byte j: the j-th; bytes past cnt are garbage). `first`: scalar absolute byte offset,
    `rank`, `cnt`: [NW] int32. Two aligned 4-byte loads, the second only where the bytes cross."""
    aligned = (first // 4) * 4
    at = (first - aligned).to(tl.int32) + rank
    words = (src_ptr + aligned).to(tl.pointer_type(tl.uint32)) + (at >> 2)
    lo = tl.load(words, mask=cnt > 0, other=0)
    hi = tl.load(words + 1, mask=(at & 3) + cnt > 4, other=0)
    sh = ((at & 3) * 8).to(tl.uint32)
    return (lo >> sh) | ((hi << (31 - sh)) << 1)  # sh = 0: hi drops out


@triton.jit
def _place(x, pre):
    """Byte b of the result is byte pre[b] of x (pre: per-byte exclusive escape counts, pre[0] = 0)."""
    z = x & 0xFF
    z |= ((x >> ((pre >> 5) & 0x18)) & 0xFF) << 8
    z |= ((x >> ((pre >> 13) & 0x18)) & 0xFF) << 16
    z |= ((x >> ((pre >> 21) & 0x18)) & 0xFF) << 24
    return z


@triton.jit
def _escapes(flags):
    """(count per word [int32], per-byte exclusive prefix, tile-exclusive rank per word) of 0/1 byte flags."""
    cnt = ((flags * 0x01010101) >> 24).to(tl.int32)
    return cnt, flags * 0x01010100, tl.cumsum(cnt, axis=0) - cnt


@triton.jit
def _level2_words(src_ptr, rec, esc, cnt, pre, rank, base_abs, table_abs, exc_abs, t, K: tl.constexpr):
    """Version 2, four per word: the symbols of the level-1 escapes (bytes flagged in `esc`).
    Escape i of the word (tile rank `rank` + i) has the k2-bit code at bit (base + rank + i) * k2
    of the level-2 code stream: the word's codes are one 32-bit window. Codes index the level-2
    table (k2 <= 3: at most 7 entries, held in two registers); code 2^k2 - 1 escapes to the next
    level-2 exception byte, ranked like the level-1 exceptions of version 1."""
    k2 = tl.load(rec + 9)
    code2_abs = tl.load(rec + 10)
    base2_abs = tl.load(rec + 11)
    base1 = _tile_base(src_ptr, base_abs, t)
    bit = code2_abs * 8 + base1 * k2  # the tile's first level-2 code
    aligned = (bit // 32) * 32
    at = (bit - aligned).to(tl.int32) + rank * k2.to(tl.int32)
    words = (src_ptr + aligned // 8).to(tl.pointer_type(tl.uint32)) + (at >> 5)
    lo = tl.load(words, mask=cnt > 0, other=0)
    hi = tl.load(words + 1, mask=(at & 31) + cnt * k2.to(tl.int32) > 32, other=0)
    sh = (at & 31).to(tl.uint32)
    codes = (lo >> sh) | ((hi << (31 - sh)) << 1)  # code i: bits [i * k2, (i + 1) * k2)
    j = tl.arange(0, 8)
    tab = tl.load(src_ptr + table_abs + ((1 << K) - 1) + j, mask=j < (1 << k2) - 1, other=0).to(tl.uint32)
    tab_lo = tl.sum(tl.where(j < 4, tab << (8 * (j & 3)).to(tl.uint32), 0), axis=0)
    tab_hi = tl.sum(tl.where(j >= 4, tab << (8 * (j & 3)).to(tl.uint32), 0), axis=0)
    m2 = ((1 << k2) - 1).to(tl.uint32)
    k2u = k2.to(tl.uint32)
    sym2 = tl.zeros_like(esc)
    esc2 = tl.zeros_like(esc)
    for b in tl.static_range(4):
        c2 = (codes >> (((pre >> (8 * b)) & 0xFF) * k2u)) & m2
        word = tl.where(c2 < 4, tab_lo, tab_hi)
        sym2 |= ((word >> ((c2 & 3) * 8)) & 0xFF) << (8 * b)
        esc2 |= ((c2 == m2).to(tl.uint32) << (8 * b)) & esc
    cnt2, pre2, rank2 = _escapes(esc2)
    x = _word_bytes(src_ptr, exc_abs + _tile_base(src_ptr, base2_abs, t), rank2, cnt2)
    m = esc2 * 0xFF
    return (sym2 & ~m) | (_place(x, pre2) & m)


@triton.jit
def _decode_tile_words(
    src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, split, window, t,
    K: tl.constexpr, TILE: tl.constexpr, DST_ALIGN: tl.constexpr, V2: tl.constexpr, V3: tl.constexpr,
):
    """A full tile whose level-1 table is the window of symbols [window, window + 2^K - 1)
    (2 <= K <= 4, window + 2^K - 1 <= 255), four elements per uint32 word (SWAR): code j
    decodes to window + j with one add per word, no table lookup; escapes are flagged per
    byte, counted per word and ranked by a prefix sum over words; version 1 reads their
    exception bytes as one 4-byte window per word and moves each to its byte, version 2
    (V2) decodes them through its level-2 code (`_level2_words`), version 3 (V3) stores them
    as they decode (window + 2^K - 1) and patches them after the tile (`_patch`)."""
    NW: tl.constexpr = TILE // 4
    wi = tl.arange(0, NW)
    raw = tl.load((src_ptr + (raw_abs // 16) * 16).to(tl.pointer_type(tl.uint32)) + t * NW + wi)
    tile_code = code_abs + t * (TILE // 8) * K
    code = tl.zeros([NW], tl.uint32)
    if K & 4:
        code |= _plane_words(src_ptr, tile_code, K, 4, TILE)
    if K & 2:
        code |= _plane_words(src_ptr, tile_code, K, 2, TILE)
    if K & 1:
        code |= _plane_words(src_ptr, tile_code, K, 1, TILE)
    sym = code + (window * 0x01010101).to(tl.uint32)
    if not V3:
        # escape flags: code 2^K - 1 carries into bit K of its byte when 1 is added (no carry past it)
        esc = ((code + 0x01010101) >> K) & 0x01010101
        cnt, pre, rank = _escapes(esc)
        if V2:
            z = _level2_words(src_ptr, rec, esc, cnt, pre, rank, base_abs, table_abs, exc_abs, t, K)
        else:
            z = _place(_word_bytes(src_ptr, exc_abs + _tile_base(src_ptr, base_abs, t), rank, cnt), pre)
        m = esc * 0xFF
        sym = (sym & ~m) | (z & m)
    out = tl.reshape(tl.join(_join16(raw, sym, split, False), _join16(raw, sym, split, True)), [2 * NW])
    dst = (dst_ptr + (dst_elem // DST_ALIGN) * DST_ALIGN + t * TILE).to(tl.pointer_type(tl.uint32))
    tl.store(dst + tl.arange(0, 2 * NW), out)
    if V3:  # (never an 8-bit tensor: those do not take the word path)
        _patch(src_ptr, dst_ptr, dst_ptr, raw_abs, base_abs, exc_abs, tl.load(rec + 13), dst_elem, split, t, TILE,
               DST_ALIGN, False)


@triton.jit
def _words_v12(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, split, window, t,
               K: tl.constexpr, TILE: tl.constexpr, DST_ALIGN: tl.constexpr, LEVEL2: tl.constexpr):
    if LEVEL2:
        if tl.load(rec + 9) > 0:
            _decode_tile_words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem,
                               split, window, t, K, TILE, DST_ALIGN, True, False)
        else:
            _decode_tile_words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem,
                               split, window, t, K, TILE, DST_ALIGN, False, False)
    else:
        _decode_tile_words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem,
                           split, window, t, K, TILE, DST_ALIGN, False, False)


@triton.jit
def _words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, split, window, t,
           K: tl.constexpr, TILE: tl.constexpr, DST_ALIGN: tl.constexpr, LEVEL2: tl.constexpr,
           PATCHED: tl.constexpr, RANKED: tl.constexpr):
    if not RANKED:  # a window tensor with escapes that are not ranked: version 3
        _decode_tile_words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem,
                           split, window, t, K, TILE, DST_ALIGN, False, True)
    elif PATCHED:
        if tl.load(rec + 13) >= 0:
            _decode_tile_words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem,
                               split, window, t, K, TILE, DST_ALIGN, False, True)
        else:
            _words_v12(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, split,
                       window, t, K, TILE, DST_ALIGN, LEVEL2)
    else:
        _words_v12(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, split, window,
                   t, K, TILE, DST_ALIGN, LEVEL2)


@triton.jit
def _decode_kernel(
    src_ptr,
    dst_ptr,
    dst8_ptr,
    table_ptr,
    num_segments,
    TILE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    DST_ALIGN: tl.constexpr,
    GATHER: tl.constexpr,
    LEVEL2: tl.constexpr,
    WORDS: tl.constexpr,
    PATCHED: tl.constexpr,
    RANKED: tl.constexpr,
    CHUNK: tl.constexpr,
    BYTES: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    # table_ptr[0 : num_segments + 1]: tile prefix sums; find seg with start[seg] <= pid < start[seg + 1]
    lo = pid * 0
    hi = lo + num_segments
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go_right = tl.load(table_ptr + mid) <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    seg = lo
    t = pid - tl.load(table_ptr + seg)

    rec = table_ptr + (num_segments + 1) + seg * _NUM_FIELDS
    raw_abs = tl.load(rec + 0)
    code_abs = tl.load(rec + 1)
    base_abs = tl.load(rec + 2)
    exc_abs = tl.load(rec + 3)
    table_abs = tl.load(rec + 4)
    dst_elem = tl.load(rec + 5)
    numel = tl.load(rec + 6)
    k = tl.load(rec + 7)
    split = tl.load(rec + 8)
    window = tl.load(rec + 12)  # -1: not a window table (see codec_format._pack_records)
    full = (t + 1) * TILE <= numel
    if WORDS and full and window >= 0 and k == 3:
        _words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, split, window, t,
               3, TILE, DST_ALIGN, LEVEL2, PATCHED, RANKED)
    elif WORDS and full and window >= 0 and k == 2:
        _words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, split, window, t,
               2, TILE, DST_ALIGN, LEVEL2, PATCHED, RANKED)
    elif WORDS and full and window >= 0 and k == 4:
        _words(src_ptr, dst_ptr, rec, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, split, window, t,
               4, TILE, DST_ALIGN, LEVEL2, PATCHED, RANKED)
    elif full:
        _decode_tile(src_ptr, dst_ptr, dst8_ptr, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, numel, k,
                     split, t, rec, TILE, DST_ALIGN, False, GATHER, LEVEL2, PATCHED, RANKED, CHUNK, BYTES)
    else:
        _decode_tile(src_ptr, dst_ptr, dst8_ptr, raw_abs, code_abs, base_abs, exc_abs, table_abs, dst_elem, numel, k,
                     split, t, rec, TILE, DST_ALIGN, True, GATHER, LEVEL2, PATCHED, RANKED, CHUNK, BYTES)
