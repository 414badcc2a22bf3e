//! SIMD inner loops of the CPU matmul on q8_0/q4_0 rows: f32 activations against block-quantised weights
//! (the K-quants' are in [`super::kdot`]; [`dot_block`] dispatches both).
//!
//! Per block, the quants widen to f32 in registers, `Σ x·q` over the block's 32 elements is formed with FMAs and
//! then scaled by the block's f16 scale into the accumulator, so the result equals dequantise-then-f32 up to
//! the order and rounding of f32 additions. Activations stay f32 (rounded to bf16/f16 by the caller, as for
//! bf16 matrices), rather than quantised to 8 bits as llama.cpp does for VNNI dot products: one pass over
//! 4.5-bit weights is bound by DRAM bandwidth, not by the FMAs (q2_k and q3_k do round them, on the GPU too:
//! see [`super::kdot`]).
//! AVX-512F and AVX2+FMA+F16C paths are chosen with the same run-time detection as [`super::simd`].
//!
//! With AVX512_BF16, q4_0 takes a shorter path: a 16-entry table lookup (`vpermw`) turns the 32 nibbles of a
//! block into the bf16 values of `q − 8` (small integers, exact in bf16), and `vdpbf16ps` multiplies them with
//! the activations converted to bf16 (exact when they hold bf16 values, as every matmul input here does; else
//! rounded as the GPU rounds them). Products of two bf16 are exact in f32, so this is still the same function.

use super::simd::Isa;
use crate::quant::{BLOCK_ELEMS, K_BLOCK_ELEMS, QFormat, round_activations};

/// Which cache a software prefetch fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLevel {
    /// L1 and below (`prefetcht0`): the line is at hand, but a miss holds one of the core's few L1 fill
    /// buffers for the whole DRAM latency.
    L1,
    /// L2 and below (`prefetcht1`): leaves the L1 fill buffers to the demand loads, which then hit L2.
    L2,
}

/// How the quantised kernels prefetch along each weight row: `bytes` ahead of the block being read (0: not
/// at all), into `level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    pub bytes: usize,
    pub level: CacheLevel,
}

impl std::fmt::Display for Prefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.bytes {
            0 => write!(f, "no prefetch"),
            b => write!(f, "prefetch {b} B to {:?}", self.level),
        }
    }
}

/// The activations as [`dot_block`] reads them for `fmt` on `isa`, made once per matmul: `m` rows of `k` f32
/// (`k` whole blocks) packed, and the packed rows' stride in f32 slots; `None` where the kernel reads the f32
/// rows themselves. q2_k and q3_k round their activations on every ISA ([`round_activations`]): the VNNI
/// kernels of AVX512_BF16 machines take the `i8` values in their lane order, with group sums
/// (`kdot::pack_k23_vnni`), so that no register block of rows does it again; the f32 kernels of other ISAs take
/// the rounded values `dx · q` as f32 rows. The AVX512_BF16 kernels of q4_k and q6_k take them as bf16, with
/// q4_k's sub-block sums (`kdot::pack_k_bf16`; no other rounding).
///
/// # Panics
/// If `x` holds fewer than `m` rows of `k`, or `k` is not a whole number of the K-quant's super-blocks.
#[must_use]
pub fn pack_x(isa: Isa, fmt: QFormat, x: &[f32], m: usize, k: usize) -> Option<(Vec<f32>, usize)> {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Bf16 && matches!(fmt, QFormat::Q4K | QFormat::Q6K) {
        assert!(x.len() >= m * k && k.is_multiple_of(K_BLOCK_ELEMS), "{m} rows of {k} activations");
        // SAFETY: `detect` returns Avx512Bf16 only where AVX-512F/BW and AVX512_BF16 are present.
        let q6 = fmt == QFormat::Q6K;
        let packed = unsafe { super::kdot::pack_k_bf16(x, m, k, q6) };
        let slots = if q6 { super::kdot::Q6K_BF16_SLOTS } else { super::kdot::Q4K_BF16_SLOTS };
        return Some((packed, k / K_BLOCK_ELEMS * slots));
    }
    if !fmt.rounds_activations() {
        return None;
    }
    assert!(x.len() >= m * k && k.is_multiple_of(K_BLOCK_ELEMS), "{m} rows of {k} activations");
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Bf16 {
        // SAFETY: `detect` returns Avx512Bf16 only where AVX-512F/BW and AVX512_VBMI are present.
        let packed = unsafe { super::kdot::pack_k23_vnni(x, m, k, fmt == QFormat::Q3K) };
        return Some((packed, k / K_BLOCK_ELEMS * super::kdot::K23_VNNI_SLOTS));
    }
    let _ = isa;
    let mut out = vec![0f32; m * k];
    let mut q = [0i8; K_BLOCK_ELEMS];
    for (xb, ob) in x[..m * k].chunks_exact(K_BLOCK_ELEMS).zip(out.chunks_exact_mut(K_BLOCK_ELEMS)) {
        let dx = round_activations(xb, &mut q);
        for (o, &v) in ob.iter_mut().zip(&q) {
            *o = f32::from(v) * dx;
        }
    }
    Some((out, k))
}

/// `out[r][t] = Σ_i x[t][i] · w[r][i]` for `R` quantised weight rows (rows of `k` elements in `fmt`, `ws` bytes
/// apart from `w`) and `T` activation rows (stride `ldx`): the f32 rows, or what [`pack_x`] made of them for
/// `isa` and `fmt` (then `ldx` is its stride).
///
/// # Safety
/// `k` is a multiple of `fmt.block_elems()`, `w + r·ws` holds a row of `fmt.row_bytes(k)` bytes for every `r < R`
/// and `x` at least `(T − 1) × ldx + k` f32s (or the packed rows); the ISA was detected.
#[inline]
pub unsafe fn dot_block<const R: usize, const T: usize>(
    isa: Isa,
    fmt: QFormat,
    pf: Prefetch,
    x: *const f32,
    ldx: usize,
    w: *const u8,
    ws: usize,
    k: usize,
    out: &mut [[f32; T]; R],
) {
    match (isa, fmt) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from the caller; Avx512Bf16 is only returned by `detect` when present.
        (Isa::Avx512Bf16, QFormat::Q4_0) => unsafe {
            x86::dot_q4_0_avx512bf16::<R, T>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above for AVX-512.
        (Isa::Avx512, QFormat::Q4_0) => unsafe {
            x86::dot_avx512::<R, T, true>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx512 | Isa::Avx512Bf16, QFormat::Q8_0) => unsafe {
            x86::dot_avx512::<R, T, false>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above for AVX2.
        (Isa::Avx2, QFormat::Q4_0) => unsafe {
            x86::dot_avx2::<R, T, true>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above for AVX2.
        (Isa::Avx2, QFormat::Q8_0) => unsafe {
            x86::dot_avx2::<R, T, false>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; k is a multiple of 256 for K-quant rows (`matmul_quant` checks it).
        (Isa::Avx512Bf16, QFormat::Q4K) => unsafe {
            super::kdot::dot_q4_k_avx512bf16::<R, T>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx512Bf16, QFormat::Q6K) => unsafe {
            super::kdot::dot_q6_k_avx512bf16::<R, T>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; AVX-512 machines have AVX2+FMA+F16C too.
        (Isa::Avx2 | Isa::Avx512, QFormat::Q4K) => unsafe {
            super::kdot::dot_q4_k_avx2::<R, T>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx2 | Isa::Avx512, QFormat::Q6K) => unsafe {
            super::kdot::dot_q6_k_avx2::<R, T>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx512Bf16, QFormat::Q2K) => unsafe {
            super::kdot::dot_q2_k_vnni::<R, T>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx512Bf16, QFormat::Q3K) => unsafe {
            super::kdot::dot_q3_k_vnni::<R, T>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above; every x86 ISA above Portable has AVX2+FMA+F16C.
        (Isa::Avx2 | Isa::Avx512, QFormat::Q2K) => unsafe {
            super::kdot::dot_k23_avx2::<R, T, false>(pf, x, ldx, w, ws, k, out);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx2 | Isa::Avx512, QFormat::Q3K) => unsafe {
            super::kdot::dot_k23_avx2::<R, T, true>(pf, x, ldx, w, ws, k, out);
        },
        _ => {
            let rb = fmt.row_bytes(k);
            let mut row = vec![0f32; k];
            for (r, o) in out.iter_mut().enumerate() {
                // SAFETY: sizes as documented.
                fmt.dequantize_row(unsafe { std::slice::from_raw_parts(w.add(r * ws), rb) }, &mut row);
                for (t, v) in o.iter_mut().enumerate() {
                    // SAFETY: sizes as documented.
                    let xs = unsafe { std::slice::from_raw_parts(x.add(t * ldx), k) };
                    *v = xs.iter().zip(&row).map(|(a, b)| a * b).sum();
                }
            }
        }
    }
}

const _: () = assert!(BLOCK_ELEMS == 32, "the kernels below unroll 32-element blocks");

/// f32 of every f16 bit pattern: a block's scale is then one broadcast load, which keeps the shuffle port
/// (the limit of the bf16 kernels) free of the f16 conversion.
pub(super) fn f16_to_f32_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(|b| half::f16::from_bits(b).to_f32()).collect())
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::cast_ptr_alignment)] // every vector load here is `loadu`, which takes any alignment
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256, __m512, __m512bh, __m512i, _MM_HINT_T0, _MM_HINT_T1, _mm_and_si128, _mm_loadu_si128,
        _mm_prefetch, _mm_set1_epi8, _mm_set1_epi16, _mm_srli_epi16, _mm_srli_si128,
        _mm256_broadcastsi128_si256, _mm256_cvtepi8_epi32, _mm256_cvtepi32_ps, _mm256_cvtepu8_epi32,
        _mm256_cvtph_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_epi16,
        _mm256_set1_epi32, _mm256_setzero_ps, _mm256_storeu_ps, _mm256_sub_epi32, _mm512_cvtepi8_epi32,
        _mm512_cvtepi32_ps, _mm512_cvtepu8_epi16, _mm512_cvtepu8_epi32, _mm512_cvtne2ps_pbh, _mm512_cvtph_ps,
        _mm512_dpbf16_ps, _mm512_fmadd_ps, _mm512_inserti64x4, _mm512_loadu_ps, _mm512_loadu_si512,
        _mm512_mul_ps, _mm512_permutexvar_epi16, _mm512_reduce_add_ps, _mm512_set1_epi32, _mm512_set1_ps,
        _mm512_setzero_ps, _mm512_setzero_si512, _mm512_srlv_epi16, _mm512_sub_epi32,
    };

    use super::{CacheLevel, Prefetch, f16_to_f32_table};
    use crate::quant::QFormat;

    /// Asks for the line `pf.bytes` past `p` (0: nothing). Prefetches never fault, so the address may lie
    /// past the matrix.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn prefetch(p: *const u8, pf: Prefetch) {
        // A prefetch is a hint: it reads nothing architecturally and never faults.
        let at = p.wrapping_add(pf.bytes).cast::<i8>();
        match (pf.bytes, pf.level) {
            (0, _) => {}
            (_, CacheLevel::L1) => _mm_prefetch::<_MM_HINT_T0>(at),
            (_, CacheLevel::L2) => _mm_prefetch::<_MM_HINT_T1>(at),
        }
    }

    /// bf16 bit patterns of `q − 8` for nibbles `q` = 0..15, twice (`vpermw` indexes 32 entries).
    const Q4_BF16: [u16; 32] = {
        let mut t = [0u16; 32];
        let mut i = 0;
        while i < 32 {
            t[i] = (((i % 16) as f32 - 8.0).to_bits() >> 16) as u16;
            i += 1;
        }
        t
    };

    /// q4_0 with AVX512_BF16; see `dot_block` and the module documentation.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_avx512bf16<const R: usize, const T: usize>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        let bb = QFormat::Q4_0.block_bytes();
        // SAFETY: the table is 64 bytes.
        let table = unsafe { _mm512_loadu_si512(Q4_BF16.as_ptr().cast::<__m512i>()) };
        // Shift counts per 16-bit lane: 0 for elements 0..16 (low nibbles), 4 for 16..32 (high nibbles).
        let shifts = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
        let scales = f16_to_f32_table().as_ptr();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for b in 0..k / 32 {
            let mut xv = [_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), _mm512_setzero_ps()); T];
            for (t, v) in xv.iter_mut().enumerate() {
                // SAFETY: block b covers elements 32b..32b+32 < k of every activation row.
                unsafe {
                    let lo = _mm512_loadu_ps(x.add(t * ldx + 32 * b));
                    let hi = _mm512_loadu_ps(x.add(t * ldx + 32 * b + 16));
                    // The second operand fills the low half: elements 0..16, then 16..32.
                    *v = _mm512_cvtne2ps_pbh(hi, lo);
                }
            }
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: block b of row r lies inside the R rows the caller guarantees (2-byte scale, 16 bytes);
                // the scale table has an entry for every 16-bit pattern.
                let (v, d) = unsafe {
                    let p = w.add(r * ws + b * bb);
                    prefetch(p, pf);
                    let bits = p.cast::<u16>().read_unaligned();
                    (
                        _mm_loadu_si128(p.add(2).cast::<__m128i>()),
                        _mm512_set1_ps(*scales.add(usize::from(bits))),
                    )
                };
                // The 16 quant bytes twice, as 16-bit lanes; the second copy shifted right by 4. `vpermw` reads
                // the low 5 bits of an index, and the table repeats after 16 entries, so the low copy needs no
                // mask: elements 0..16 take the low nibbles, 16..32 the high ones.
                let idx = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(v)), shifts);
                // SAFETY: __m512i and __m512bh are both 512 bits of plain data.
                let wv: __m512bh = unsafe { std::mem::transmute(_mm512_permutexvar_epi16(idx, table)) };
                for (t, a) in row.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv[t], wv), d, *a);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
            }
        }
    }

    /// The block's 32 weights as f32 quants (q − 8 for q4_0), in element order, 16 per vector.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn quants16x2<const Q4: bool>(p: *const u8) -> (__m512, __m512) {
        if Q4 {
            // SAFETY: a q4_0 block has 16 quant bytes after its 2-byte scale.
            let v = unsafe { _mm_loadu_si128(p.add(2).cast::<__m128i>()) };
            let m = _mm_set1_epi8(0x0f);
            let eight = _mm512_set1_epi32(8);
            let lo = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(v, m)), eight);
            let hi = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), m)), eight);
            (_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi))
        } else {
            // SAFETY: a q8_0 block has 32 quant bytes after its 2-byte scale.
            let (a, b) = unsafe {
                (_mm_loadu_si128(p.add(2).cast::<__m128i>()), _mm_loadu_si128(p.add(18).cast::<__m128i>()))
            };
            (_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)))
        }
    }

    /// The block's f16 scale, widened and broadcast.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn scale16(p: *const u8) -> __m512 {
        // SAFETY: every block starts with its 2-byte scale.
        let bits = unsafe { p.cast::<i16>().read_unaligned() };
        _mm512_cvtph_ps(_mm256_set1_epi16(bits))
    }

    /// AVX-512 kernel; see `dot_block`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn dot_avx512<const R: usize, const T: usize, const Q4: bool>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        let fmt = if Q4 { QFormat::Q4_0 } else { QFormat::Q8_0 };
        let bb = fmt.block_bytes();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for b in 0..k / 32 {
            let mut xv = [[_mm512_setzero_ps(); 2]; T];
            for (t, v) in xv.iter_mut().enumerate() {
                // SAFETY: block b covers elements 32b..32b+32 < k of every activation row.
                unsafe {
                    v[0] = _mm512_loadu_ps(x.add(t * ldx + 32 * b));
                    v[1] = _mm512_loadu_ps(x.add(t * ldx + 32 * b + 16));
                }
            }
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: block b of row r lies inside the R rows the caller guarantees.
                let (w0, w1, d) = unsafe {
                    let p = w.add(r * ws + b * bb);
                    prefetch(p, pf);
                    let (w0, w1) = quants16x2::<Q4>(p);
                    (w0, w1, scale16(p))
                };
                for (t, a) in row.iter_mut().enumerate() {
                    let s = _mm512_fmadd_ps(xv[t][1], w1, _mm512_mul_ps(xv[t][0], w0));
                    *a = _mm512_fmadd_ps(s, d, *a);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum8(v: __m256) -> f32 {
        let mut a = [0f32; 8];
        // SAFETY: a has 8 f32.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
    }

    /// The block's 32 weights as f32 quants, 8 per vector.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants8x4<const Q4: bool>(p: *const u8) -> [__m256; 4] {
        if Q4 {
            // SAFETY: a q4_0 block has 16 quant bytes after its 2-byte scale.
            let v = unsafe { _mm_loadu_si128(p.add(2).cast::<__m128i>()) };
            let m = _mm_set1_epi8(0x0f);
            let eight = _mm256_set1_epi32(8);
            let (lo, hi) = (_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
            let f = |h: __m128i| _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(h), eight));
            [f(lo), f(_mm_srli_si128(lo, 8)), f(hi), f(_mm_srli_si128(hi, 8))]
        } else {
            // SAFETY: a q8_0 block has 32 quant bytes after its 2-byte scale.
            let (a, b) = unsafe {
                (_mm_loadu_si128(p.add(2).cast::<__m128i>()), _mm_loadu_si128(p.add(18).cast::<__m128i>()))
            };
            let f = |h: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h));
            [f(a), f(_mm_srli_si128(a, 8)), f(b), f(_mm_srli_si128(b, 8))]
        }
    }

    /// AVX2 kernel; see `dot_block`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2<const R: usize, const T: usize, const Q4: bool>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        let fmt = if Q4 { QFormat::Q4_0 } else { QFormat::Q8_0 };
        let bb = fmt.block_bytes();
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for b in 0..k / 32 {
            let mut xv = [[_mm256_setzero_ps(); 4]; T];
            for (t, v) in xv.iter_mut().enumerate() {
                for (c, vc) in v.iter_mut().enumerate() {
                    // SAFETY: block b covers elements 32b..32b+32 < k.
                    *vc = unsafe { _mm256_loadu_ps(x.add(t * ldx + 32 * b + 8 * c)) };
                }
            }
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: block b of row r lies inside the R rows the caller guarantees.
                let (q, d) = unsafe {
                    let p = w.add(r * ws + b * bb);
                    prefetch(p, pf);
                    (quants8x4::<Q4>(p), _mm256_cvtph_ps(_mm_set1_epi16(p.cast::<i16>().read_unaligned())))
                };
                for (t, a) in row.iter_mut().enumerate() {
                    let mut s = _mm256_mul_ps(xv[t][0], q[0]);
                    for c in 1..4 {
                        s = _mm256_fmadd_ps(xv[t][c], q[c], s);
                    }
                    *a = _mm256_fmadd_ps(s, d, *a);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[r][t] = hsum8(acc[r][t]);
            }
        }
    }
}
