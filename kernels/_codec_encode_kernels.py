"""Triton bodies for `weightstream.kernels.codec_encode_gpu` (private).

Every launch covers all the tensors ("jobs") of one encode: the grid is the total number of
TILE-element tiles over the jobs (`_histogram_kernel`, `_code_kernel`, `_escape_kernel`) and each
program finds its job in a per-tile job index, then reads the job's record (the fields below,
packed by `codec_encode_gpu._records`):

1. `_histogram_kernel`: the symbol histogram of its tile, added to the job's full histogram and,
   when the tile lies in a sampled chunk (every 4th of `STEP` elements for tensors the CPU
   encoder samples), to its sampled one (atomics; the host chooses k and the tables from them).
2. `_code_kernel`: the raw byte of every element, the k-bit codes (a 256-entry lookup per job
   and level) packed into the tile's bit planes, and the tile's level-1 (and level-2) escape
   counts.
3. `_escape_kernel` (jobs with escapes): the tile's base (its exclusive prefix of the escape
   counts), the escapes ranked with a prefix sum over the tile and compacted: exception symbols
   (version 1), level-2 codes into a scratch buffer plus level-2 exceptions and bases (version 2),
   uint16 positions and symbols (version 3, patches).
4. `_pack2_kernel` (version 2): the level-2 codes packed densely, k2 bits each.

Payload is handled as integers only, so the coded bytes are exact on raw bits.
"""
import triton
import triton.language as tl

# int64 fields per job record; must match `codec_encode_gpu._records`.
_NUM_FIELDS = tl.constexpr(16)
# 0 src_off  1 numel  2 nbytes  3 split  4 tile_start  5 out_off  6 raw_off  7 code_off  8 base_off
# 9 exc_off  10 k  11 k2  12 tmp2_off  13 base2_off  14 patch_sym_off (-1: not patched)  15 sample


@triton.jit
def _symbols(src_ptr, rec, idx):
    """(symbol, raw byte, in-range mask) of the elements `idx` (any shape) of the job at `rec`."""
    src_off = tl.load(rec + 0)
    numel = tl.load(rec + 1)
    nbytes = tl.load(rec + 2)
    split = tl.load(rec + 3)
    m = idx < numel
    byte = (idx * 0 + split) == 2  # 8-bit elements (float8): the byte is the symbol, no raw byte
    v = tl.load((src_ptr + src_off).to(tl.pointer_type(tl.int16)) + idx, mask=m & (~byte), other=0).to(tl.int32)
    v = v & 0xFFFF
    v = tl.where(2 * idx + 1 < nbytes, v, v & 0xFF)  # an odd byte count: the last element's high byte is 0
    bf16 = (idx * 0 + split) == 0  # a vector: the interpreter cannot AND a scalar bool into a mask
    sym = tl.where(bf16, (v >> 7) & 0xFF, v >> 8)
    raw = tl.where(bf16, (v & 0x7F) | ((v >> 8) & 0x80), v & 0xFF)
    b8 = tl.load(src_ptr + src_off + idx, mask=m & byte, other=0).to(tl.int32)
    return tl.where(byte, b8, sym), raw, m


@triton.jit
def _histogram_kernel(src_ptr, rec_ptr, tile_job_ptr, hist_ptr, TILE: tl.constexpr, STEP: tl.constexpr):
    t = tl.program_id(0)
    j = tl.load(tile_job_ptr + t).to(tl.int64)
    rec = rec_ptr + j * _NUM_FIELDS
    local = t - tl.load(rec + 4)
    sym, _, m = _symbols(src_ptr, rec, local * TILE + tl.arange(0, TILE))
    h = tl.histogram(sym, 256, mask=m)
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_ptr + j * 512 + bins, h)
    sample = tl.load(rec + 15)
    sampled = ((local * TILE) // STEP) % sample == 0
    tl.atomic_add(hist_ptr + j * 512 + 256 + bins, h, mask=(bins * 0 + sampled.to(tl.int32)) != 0)


@triton.jit
def _plane(code, out_ptr, code_at, k, W: tl.constexpr, TILE: tl.constexpr):
    """Bit plane W of a tile from its codes ([8, TILE / 8], element order), if k has it: byte j
    packs elements j + s * SPAN (s < 8 / W, SPAN = TILE * W / 8) at bit W * s; rows r = s * W + j // (TILE / 8)."""
    if (k & W) != 0:
        start = code_at + (TILE // 8) * (k & ~(2 * W - 1))  # wider planes come first
        if W == 8:  # one element per byte: the codes as they are
            tl.store(out_ptr + start + tl.arange(0, TILE), tl.reshape(code, [TILE]).to(tl.uint8))
        else:
            bits = (code >> (k & (W - 1)).to(tl.int32)) & ((1 << W) - 1)
            s = tl.arange(0, 8 // W)[:, None, None]
            byte = tl.sum(tl.reshape(bits, [8 // W, W, TILE // 8]) << (W * s), axis=0)
            tl.store(out_ptr + start + tl.arange(0, TILE * W // 8), tl.reshape(byte, [TILE * W // 8]).to(tl.uint8))


@triton.jit
def _code_kernel(src_ptr, out_ptr, rec_ptr, tile_job_ptr, lut_ptr, count_ptr, count2_ptr, TILE: tl.constexpr):
    t = tl.program_id(0)
    j = tl.load(tile_job_ptr + t).to(tl.int64)
    rec = rec_ptr + j * _NUM_FIELDS
    lut = lut_ptr + j * 512
    local = t - tl.load(rec + 4)
    out = tl.load(rec + 5)
    k = tl.load(rec + 10)
    k2 = tl.load(rec + 11)
    # the tile as [8, TILE / 8] (element order): every plane is a reshape of it, no reload
    idx = local * TILE + tl.arange(0, 8)[:, None] * (TILE // 8) + tl.arange(0, TILE // 8)[None, :]
    sym, raw, m = _symbols(src_ptr, rec, idx)
    code = tl.load(lut + sym, mask=m, other=0).to(tl.int32)  # padding: code 0
    tl.store(out_ptr + out + tl.load(rec + 6) + idx, raw.to(tl.uint8), mask=m & ((idx * 0 + tl.load(rec + 3)) != 2))
    code_at = out + tl.load(rec + 7) + local * (TILE * k // 8)
    _plane(code, out_ptr, code_at, k, 8, TILE)
    _plane(code, out_ptr, code_at, k, 4, TILE)
    _plane(code, out_ptr, code_at, k, 2, TILE)
    _plane(code, out_ptr, code_at, k, 1, TILE)
    tl.store(count_ptr + t, 0)
    tl.store(count2_ptr + t, 0)
    if (k >= 1) & (k <= 7):
        esc = m & (code == (1 << (idx * 0 + k)) - 1)
        tl.store(count_ptr + t, tl.sum(tl.sum(esc.to(tl.int32), axis=1), axis=0))
        if k2 >= 1:
            code2 = tl.load(lut + 256 + sym, mask=esc, other=0).to(tl.int32)
            esc2 = esc & (code2 == (1 << (idx * 0 + k2)) - 1)
            tl.store(count2_ptr + t, tl.sum(tl.sum(esc2.to(tl.int32), axis=1), axis=0))


@triton.jit
def _escape_kernel(src_ptr, out_ptr, rec_ptr, tile_job_ptr, lut_ptr, excl_ptr, excl2_ptr, tmp2_ptr,
                   TILE: tl.constexpr):
    t = tl.program_id(0)
    j = tl.load(tile_job_ptr + t).to(tl.int64)
    rec = rec_ptr + j * _NUM_FIELDS
    lut = lut_ptr + j * 512
    start = tl.load(rec + 4)
    local = t - start
    k = tl.load(rec + 10)
    if (k >= 1) & (k <= 7):
        out = tl.load(rec + 5)
        k2 = tl.load(rec + 11)
        psym = tl.load(rec + 14)
        idx = local * TILE + tl.arange(0, TILE)
        sym, _, m = _symbols(src_ptr, rec, idx)
        code = tl.load(lut + sym, mask=m, other=0).to(tl.int32)
        esc = m & (code == (1 << (idx * 0 + k)) - 1)
        e = esc.to(tl.int32)
        base = tl.load(excl_ptr + t) - tl.load(excl_ptr + start)
        rank = base + (tl.cumsum(e, axis=0) - e).to(tl.int64)
        tl.store((out_ptr + out + tl.load(rec + 8)).to(tl.pointer_type(tl.int64)) + local, base)
        exc = out + tl.load(rec + 9)
        if psym >= 0:  # version 3: uint16 positions in the tile, then the symbols
            tl.store((out_ptr + exc).to(tl.pointer_type(tl.int16)) + rank, (idx - local * TILE).to(tl.int16),
                     mask=esc)
            tl.store(out_ptr + out + psym + rank, sym.to(tl.uint8), mask=esc)
        elif k2 == 0:
            tl.store(out_ptr + exc + rank, sym.to(tl.uint8), mask=esc)
        else:  # version 2: every escape's level-2 code (packed by _pack2_kernel), level-2 escapes
            code2 = tl.load(lut + 256 + sym, mask=esc, other=0).to(tl.int32)
            tl.store(tmp2_ptr + tl.load(rec + 12) + rank, code2.to(tl.uint8), mask=esc)
            esc2 = esc & (code2 == (1 << (idx * 0 + k2)) - 1)
            e2 = esc2.to(tl.int32)
            base2 = tl.load(excl2_ptr + t) - tl.load(excl2_ptr + start)
            rank2 = base2 + (tl.cumsum(e2, axis=0) - e2).to(tl.int64)
            tl.store((out_ptr + out + tl.load(rec + 13)).to(tl.pointer_type(tl.int64)) + local, base2)
            tl.store(out_ptr + exc + rank2, sym.to(tl.uint8), mask=esc2)


@triton.jit
def _pack2_kernel(out_ptr, rec_ptr, jobs_ptr, tmp2_ptr, esc_ptr, code2_ptr, BLOCK: tl.constexpr):
    """Byte b of a job's level-2 code stream: the codes r with bits in [8 b, 8 b + 8) (r * k2 on)."""
    j = tl.load(jobs_ptr + tl.program_id(1)).to(tl.int64)
    rec = rec_ptr + j * _NUM_FIELDS
    k2 = tl.load(rec + 11)
    n = tl.load(esc_ptr + tl.program_id(1))
    nb = (n * k2 + 7) // 8
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    r0 = (8 * b) // k2
    tmp = tmp2_ptr + tl.load(rec + 12)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for c in tl.static_range(9):
        r = r0 + c
        ok = (b < nb) & (r < n) & (r * k2 < 8 * b + 8)
        v = tl.load(tmp + r, mask=ok, other=0).to(tl.int32)
        sh = (r * k2 - 8 * b).to(tl.int32)  # in (-k2, 8)
        part = tl.where(sh >= 0, v << tl.maximum(sh, 0), v >> tl.maximum(-sh, 0))
        acc = acc | tl.where(ok, part, 0)
    tl.store(out_ptr + tl.load(code2_ptr + tl.program_id(1)) + b, (acc & 0xFF).to(tl.uint8), mask=b < nb)
