//! SIMD inner loops of the CPU matmul on K-quant rows (q2_k, q3_k, q4_k, q6_k): f32 activations against
//! 256-element super-blocks, for [`super::qdot::dot_block`].
//!
//! Per super-block and row the scales are decoded once into f32 (q4_k: `d·sc` and `dmin·m` per sub-block of
//! 32; q6_k: `d·scale` per group of 16; q2_k: `d·sc` and `dmin·m` per 16; q3_k: `d·(sc − 32)` per 16), then
//! each sub-block adds `d·sc·Σ x·q − dmin·m·Σ x` (q2_k, q4_k) or `d·scale·Σ x·q` (q3_k, q6_k, signed quants)
//! to the row's accumulator. The activation loads, their bf16 conversion and the sums `Σ x` are shared by the
//! rows of a register block. The result equals dequantise-then-f32 up to the order and rounding of f32
//! additions, as for q4_0.
//!
//! With AVX512_BF16 the quants become bf16 by table lookups (`vpermw` on nibbles for q4_k and on 2-bit fields
//! for q2_k; `vpermt2w` on those with the mask bits for q3_k, and on the 6-bit values for q6_k, a 64-entry
//! table of `q − 32`), exact as small integers, and `vdpbf16ps` multiplies them with the activations (bf16
//! values already, so exact too). q2_k and q3_k take their activations packed once per matmul
//! ([`pack_k23_avx512bf16`]). Other x86 machines with AVX2+FMA (AVX-512 ones without BF16 included) widen the
//! quants to f32 and use FMAs.

#[cfg(target_arch = "x86_64")]
pub use x86::{
    dot_k23_avx2, dot_k23_avx512bf16, dot_q4_k_avx2, dot_q4_k_avx512bf16, dot_q6_k_avx2, dot_q6_k_avx512bf16,
    k23_packed_len, pack_k23_avx512bf16,
};

/// The 8 six-bit scales and the 8 six-bit mins of a q4_k super-block's 12 packed bytes (`sc[0..8]`,
/// `m[0..8]`, as ggml's `get_scale_min_k4` reads them one by one), unpacked four at a time in 32-bit words:
/// sub-blocks 0..4 sit in the low 6 bits of bytes 0..4 (scales) and 4..8 (mins); sub-blocks 4..8 in the
/// nibbles of bytes 8..12, with their top 2 bits in the top bits of bytes 0..8. In general-purpose registers on
/// purpose: the AVX512_BF16 kernel is bound by the vector shuffle port, and the same unpacking in SIMD lanes
/// (two more shuffles a super-block and row) measured slower (results/exec/quant, K-quant runs 1 and 2).
#[inline]
#[must_use]
pub fn q4_k_scales_mins(packed: [u8; 12]) -> [u8; 16] {
    let word = |i: usize| u32::from_le_bytes([packed[i], packed[i + 1], packed[i + 2], packed[i + 3]]);
    let (s0, s1, s2) = (word(0), word(4), word(8));
    let sc_hi = (s2 & 0x0f0f_0f0f) | (((s0 >> 6) & 0x0303_0303) << 4);
    let m_hi = ((s2 >> 4) & 0x0f0f_0f0f) | (((s1 >> 6) & 0x0303_0303) << 4);
    let mut out = [0u8; 16];
    for (i, w) in [s0 & 0x3f3f_3f3f, sc_hi, s1 & 0x3f3f_3f3f, m_hi].into_iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out
}

/// The 16 six-bit scales (0..64, before the offset 32) of a q3_k super-block's 12 packed bytes, as
/// `quant::q3_k_scales` reads them one by one, four at a time in 32-bit words: scales 0..4 and 4..8
/// have their low 4 bits in the low nibbles of bytes 0..4 and 4..8, scales 8..12 and 12..16 in the high ones;
/// bytes 8..12 hold the top 2 bits of scales j, 4 + j, 8 + j, 12 + j at bits 0, 2, 4, 6 of byte 8 + j.
#[inline]
#[must_use]
pub fn q3_k_scales_words(packed: [u8; 12]) -> [u8; 16] {
    let word = |i: usize| u32::from_le_bytes([packed[i], packed[i + 1], packed[i + 2], packed[i + 3]]);
    let (s0, s1, s2) = (word(0), word(4), word(8));
    let (lo, hi) = (0x0f0f_0f0f, 0x0303_0303);
    let mut out = [0u8; 16];
    for (i, (low, shift)) in
        [(s0 & lo, 0), (s1 & lo, 2), ((s0 >> 4) & lo, 4), ((s1 >> 4) & lo, 6)].into_iter().enumerate()
    {
        let w = low | (((s2 >> shift) & hi) << 4);
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::cast_ptr_alignment)] // every vector load here is `loadu`, which takes any alignment
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256, __m256i, __m512, __m512bh, __m512i, _MM_HINT_T0, _MM_HINT_T1, _mm_cvtsi32_si128,
        _mm_loadu_ps, _mm_loadu_si128, _mm_prefetch, _mm_setr_epi16, _mm_srli_si128, _mm256_add_ps,
        _mm256_and_si256, _mm256_castpd_ps, _mm256_castps_pd, _mm256_castsi256_si128, _mm256_cvtepi8_epi32,
        _mm256_cvtepi32_ps, _mm256_cvtepu8_epi32, _mm256_extracti128_si256, _mm256_fmadd_ps,
        _mm256_fnmadd_ps, _mm256_hadd_ps, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_mul_ps,
        _mm256_or_si256, _mm256_permute2f128_ps, _mm256_set1_epi8, _mm256_set1_ps, _mm256_setzero_ps,
        _mm256_slli_epi16, _mm256_srl_epi16, _mm256_srli_epi16, _mm256_storeu_ps, _mm256_sub_epi8,
        _mm512_add_ps, _mm512_and_si512, _mm512_broadcast_f32x4, _mm512_broadcast_i32x4, _mm512_castpd_ps,
        _mm512_castps_pd, _mm512_castps256_ps512, _mm512_castps512_ps256, _mm512_castsi128_si512,
        _mm512_castsi256_si512, _mm512_cvtepi8_epi32, _mm512_cvtepi32_ps, _mm512_cvtepu8_epi16,
        _mm512_cvtepu8_epi32, _mm512_cvtne2ps_pbh, _mm512_dpbf16_ps, _mm512_extractf64x4_pd, _mm512_fmadd_ps,
        _mm512_fnmadd_ps, _mm512_insertf64x4, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mask_blend_ps,
        _mm512_maskz_permutexvar_epi8, _mm512_mul_ps, _mm512_or_si512, _mm512_permutex2var_epi8,
        _mm512_permutex2var_epi16, _mm512_permutexvar_epi16, _mm512_permutexvar_epi32, _mm512_permutexvar_ps,
        _mm512_reduce_add_ps, _mm512_set1_epi16, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setr_epi32,
        _mm512_setzero_pd, _mm512_setzero_ps, _mm512_setzero_si512, _mm512_shuffle_f32x4, _mm512_slli_epi16,
        _mm512_srli_epi16, _mm512_srli_epi32, _mm512_srlv_epi16, _mm512_storeu_ps, _mm512_storeu_si512,
        _mm512_sub_epi32, _mm512_ternarylogic_epi32,
    };

    use super::super::qdot::{CacheLevel, Prefetch, f16_to_f32_table};
    use super::{q3_k_scales_words, q4_k_scales_mins};

    const Q4K_BYTES: usize = 144;
    const Q2K_BYTES: usize = 84;
    const Q3K_BYTES: usize = 110;
    const Q6K_BYTES: usize = 210;

    /// Prefetches every cache line of the block at `p`, `pf.bytes` ahead (a hint: never faults).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn prefetch_block(p: *const u8, block_bytes: usize, pf: Prefetch) {
        if pf.bytes == 0 {
            return;
        }
        for off in (0..block_bytes).step_by(64) {
            let at = p.wrapping_add(pf.bytes + off).cast::<i8>();
            match pf.level {
                CacheLevel::L1 => _mm_prefetch::<_MM_HINT_T0>(at),
                CacheLevel::L2 => _mm_prefetch::<_MM_HINT_T1>(at),
            }
        }
    }

    fn f16(p: *const u8, at: usize) -> f32 {
        // SAFETY: callers pass a block pointer with its f16 at `at`.
        half::f16::from_bits(unsafe { p.add(at).cast::<u16>().read_unaligned() }).to_f32()
    }

    /// `[d·sc_0..8 | dmin·m_0..8]` of the q4_k super-block at `p`.
    ///
    /// # Safety
    /// `p` points at a whole super-block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k_factors(p: *const u8) -> [f32; 16] {
        // SAFETY: bytes 4..16 of the block.
        let packed: [u8; 12] = unsafe { p.add(4).cast::<[u8; 12]>().read_unaligned() };
        let sm = q4_k_scales_mins(packed);
        // SAFETY: sm has 16 bytes; the loads take 8 each.
        let (sc, mn) = unsafe {
            let v = _mm_loadu_si128(sm.as_ptr().cast::<__m128i>());
            (
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))),
            )
        };
        let mut out = [0f32; 16];
        // SAFETY: out has 16 f32.
        unsafe {
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(f16(p, 0)), sc));
            _mm256_storeu_ps(out.as_mut_ptr().add(8), _mm256_mul_ps(_mm256_set1_ps(f16(p, 2)), mn));
        }
        out
    }

    fn hsum8(v: __m256) -> f32 {
        let mut a = [0f32; 8];
        // SAFETY: a has 8 f32.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
    }

    /// 32 bytes as 4 vectors of 8 f32 (unsigned, or signed when `SIGNED`), in order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn bytes_to_f32x32<const SIGNED: bool>(v: __m256i) -> [__m256; 4] {
        let (a, b) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let f = |h: __m128i| {
            _mm256_cvtepi32_ps(if SIGNED { _mm256_cvtepi8_epi32(h) } else { _mm256_cvtepu8_epi32(h) })
        };
        [f(a), f(_mm_srli_si128(a, 8)), f(b), f(_mm_srli_si128(b, 8))]
    }

    /// The activations `x[t·ldx + at..at + 32]` of each token, 8 per vector.
    ///
    /// # Safety
    /// The elements exist.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_x<const T: usize>(x: *const f32, ldx: usize, at: usize) -> [[__m256; 4]; T] {
        let mut xv = [[_mm256_setzero_ps(); 4]; T];
        for (t, v) in xv.iter_mut().enumerate() {
            for (c, vc) in v.iter_mut().enumerate() {
                // SAFETY: as documented.
                *vc = unsafe { _mm256_loadu_ps(x.add(t * ldx + at + 8 * c)) };
            }
        }
        xv
    }

    /// q4_k with AVX2+FMA; see `qdot::dot_block`.
    ///
    /// # Safety
    /// As `qdot::dot_block`, with `k` a multiple of 256; AVX2, FMA and F16C are present.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_k_avx2<const R: usize, const T: usize>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mask = _mm256_set1_epi8(0x0f);
        for b in 0..k / 256 {
            let mut f = [[0f32; 16]; R];
            for (r, fr) in f.iter_mut().enumerate() {
                // SAFETY: super-block b of row r exists (the caller's sizes).
                unsafe {
                    let p = w.add(r * ws + b * Q4K_BYTES);
                    prefetch_block(p, Q4K_BYTES, pf);
                    *fr = q4_k_factors(p);
                }
            }
            for c in 0..4 {
                // SAFETY: elements 256b + 64c .. + 64 of every token exist.
                let (xlo, xhi) = unsafe {
                    (load_x::<T>(x, ldx, 256 * b + 64 * c), load_x::<T>(x, ldx, 256 * b + 64 * c + 32))
                };
                let sums =
                    |v: &[__m256; 4]| _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
                for (r, row) in acc.iter_mut().enumerate() {
                    // SAFETY: nibble chunk c of the super-block.
                    let q = unsafe {
                        _mm256_loadu_si256(w.add(r * ws + b * Q4K_BYTES + 16 + 32 * c).cast::<__m256i>())
                    };
                    let lo = bytes_to_f32x32::<false>(_mm256_and_si256(q, mask));
                    let hi = bytes_to_f32x32::<false>(_mm256_and_si256(_mm256_srli_epi16::<4>(q), mask));
                    let fr = &f[r];
                    for (t, a) in row.iter_mut().enumerate() {
                        for (half, (xv, qv)) in [(&xlo[t], &lo), (&xhi[t], &hi)].into_iter().enumerate() {
                            let mut s = _mm256_mul_ps(xv[0], qv[0]);
                            for i in 1..4 {
                                s = _mm256_fmadd_ps(xv[i], qv[i], s);
                            }
                            let j = 2 * c + half;
                            *a = _mm256_fmadd_ps(s, _mm256_set1_ps(fr[j]), *a);
                            *a = _mm256_fnmadd_ps(sums(xv), _mm256_set1_ps(fr[8 + j]), *a);
                        }
                    }
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[r][t] = hsum8(acc[r][t]);
            }
        }
    }

    /// q6_k with AVX2+FMA; see `qdot::dot_block`.
    ///
    /// # Safety
    /// As [`dot_q4_k_avx2`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q6_k_avx2<const R: usize, const T: usize>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let (mask4, mask2, off) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x03), _mm256_set1_epi8(32));
        for b in 0..k / 256 {
            let mut ds = [[0f32; 16]; R];
            for (r, dr) in ds.iter_mut().enumerate() {
                // SAFETY: super-block b of row r exists.
                unsafe {
                    let p = w.add(r * ws + b * Q6K_BYTES);
                    prefetch_block(p, Q6K_BYTES, pf);
                    let d = f16(p, 208);
                    for (g, v) in dr.iter_mut().enumerate() {
                        *v = d * f32::from(p.add(192 + g).cast::<i8>().read());
                    }
                }
            }
            for h in 0..2 {
                for c in 0..4 {
                    // SAFETY: elements 256b + 128h + 32c .. + 32 of every token exist.
                    let xv = unsafe { load_x::<T>(x, ldx, 256 * b + 128 * h + 32 * c) };
                    for (r, row) in acc.iter_mut().enumerate() {
                        // SAFETY: the low-nibble and high-pair bytes of quarter c of half h.
                        let (ql, qh) = unsafe {
                            let p = w.add(r * ws + b * Q6K_BYTES);
                            (
                                _mm256_loadu_si256(p.add(64 * h + 32 * (c % 2)).cast::<__m256i>()),
                                _mm256_loadu_si256(p.add(128 + 32 * h).cast::<__m256i>()),
                            )
                        };
                        let lo = if c < 2 { ql } else { _mm256_srli_epi16::<4>(ql) };
                        let hi = match c {
                            0 => qh,
                            1 => _mm256_srli_epi16::<2>(qh),
                            2 => _mm256_srli_epi16::<4>(qh),
                            _ => _mm256_srli_epi16::<6>(qh),
                        };
                        // Each byte's high pair to bits 4..6 (masked first, so no bits cross bytes), minus 32.
                        let q6 = _mm256_or_si256(
                            _mm256_and_si256(lo, mask4),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(hi, mask2)),
                        );
                        let qv = bytes_to_f32x32::<true>(_mm256_sub_epi8(q6, off));
                        let g = 8 * h + 2 * c;
                        for (t, a) in row.iter_mut().enumerate() {
                            let s0 = _mm256_fmadd_ps(xv[t][1], qv[1], _mm256_mul_ps(xv[t][0], qv[0]));
                            let s1 = _mm256_fmadd_ps(xv[t][3], qv[3], _mm256_mul_ps(xv[t][2], qv[2]));
                            *a = _mm256_fmadd_ps(s0, _mm256_set1_ps(ds[r][g]), *a);
                            *a = _mm256_fmadd_ps(s1, _mm256_set1_ps(ds[r][g + 1]), *a);
                        }
                    }
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[r][t] = hsum8(acc[r][t]);
            }
        }
    }

    /// q2_k (`Q3` false) or q3_k with AVX2+FMA; see `qdot::dot_block`. Per super-block and row the 16 group
    /// factors are decoded once (q2_k: `d·sc` and `dmin·m`; q3_k: `d·(sc − 32)`); per quarter of 32 elements the
    /// 2-bit fields (and q3_k's mask bit) of one 32-byte load widen to f32, and each group of 16 adds
    /// `d·sc·Σ x·q` (− `dmin·m·Σ x`, whose `Σ x` the rows share).
    ///
    /// # Safety
    /// As [`dot_q4_k_avx2`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_k23_avx2<const R: usize, const T: usize, const Q3: bool>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        let bb = if Q3 { Q3K_BYTES } else { Q2K_BYTES };
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let (mask2, one, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1), _mm256_set1_epi8(4));
        for b in 0..k / 256 {
            // Per row: the groups' scale factors (and q2_k's min factors).
            let (mut ds, mut dm) = ([[0f32; 16]; R], [[0f32; 16]; R]);
            for r in 0..R {
                // SAFETY: super-block b of row r exists.
                unsafe {
                    let p = w.add(r * ws + b * bb);
                    prefetch_block(p, bb, pf);
                    if Q3 {
                        let sc = crate::quant::q3_k_scales(std::slice::from_raw_parts(p.add(96), 12));
                        let d = f16(p, 108);
                        for (g, v) in ds[r].iter_mut().enumerate() {
                            *v = d * f32::from(i16::from(sc[g]) - 32);
                        }
                    } else {
                        let (d, dmin) = (f16(p, 80), f16(p, 82));
                        for g in 0..16 {
                            let sc = *p.add(g);
                            ds[r][g] = d * f32::from(sc & 0x0f);
                            dm[r][g] = dmin * f32::from(sc >> 4);
                        }
                    }
                }
            }
            for n in 0..2 {
                for j in 0..4 {
                    // SAFETY: elements 256b + 128n + 32j .. + 32 of every token exist.
                    let xv = unsafe { load_x::<T>(x, ldx, 256 * b + 128 * n + 32 * j) };
                    let xs: [[__m256; 2]; T] = std::array::from_fn(|t| {
                        [_mm256_add_ps(xv[t][0], xv[t][1]), _mm256_add_ps(xv[t][2], xv[t][3])]
                    });
                    let shift = _mm_cvtsi32_si128(2 * j as i32);
                    let g = 8 * n + 2 * j;
                    for (r, row) in acc.iter_mut().enumerate() {
                        // SAFETY: the half's 32 quant bytes (and q3_k's 32 mask bytes) of super-block b, row r.
                        let qv = unsafe {
                            let p = w.add(r * ws + b * bb);
                            let q = _mm256_and_si256(
                                _mm256_srl_epi16(
                                    _mm256_loadu_si256(
                                        p.add(if Q3 { 32 } else { 16 } + 32 * n).cast::<__m256i>(),
                                    ),
                                    shift,
                                ),
                                mask2,
                            );
                            if Q3 {
                                // q − 4 with q = low bits + 4 where bit 4n + j of the mask byte is set.
                                let hbit = _mm256_and_si256(
                                    _mm256_srl_epi16(
                                        _mm256_loadu_si256(p.cast::<__m256i>()),
                                        _mm_cvtsi32_si128((4 * n + j) as i32),
                                    ),
                                    one,
                                );
                                bytes_to_f32x32::<true>(_mm256_sub_epi8(
                                    _mm256_or_si256(q, _mm256_slli_epi16::<2>(hbit)),
                                    four,
                                ))
                            } else {
                                bytes_to_f32x32::<false>(q)
                            }
                        };
                        for (t, a) in row.iter_mut().enumerate() {
                            let s0 = _mm256_fmadd_ps(xv[t][1], qv[1], _mm256_mul_ps(xv[t][0], qv[0]));
                            let s1 = _mm256_fmadd_ps(xv[t][3], qv[3], _mm256_mul_ps(xv[t][2], qv[2]));
                            *a = _mm256_fmadd_ps(s0, _mm256_set1_ps(ds[r][g]), *a);
                            *a = _mm256_fmadd_ps(s1, _mm256_set1_ps(ds[r][g + 1]), *a);
                            if !Q3 {
                                *a = _mm256_fnmadd_ps(xs[t][0], _mm256_set1_ps(dm[r][g]), *a);
                                *a = _mm256_fnmadd_ps(xs[t][1], _mm256_set1_ps(dm[r][g + 1]), *a);
                            }
                        }
                    }
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[r][t] = hsum8(acc[r][t]);
            }
        }
    }

    /// bf16 bit pattern of the small integer `v` (exact).
    const fn bf16_int(v: i32) -> u16 {
        ((v as f32).to_bits() >> 16) as u16
    }

    /// bf16 bit patterns of `((i >> shift) & mask) − off` for `i` in 0..32: a `vpermw` table (which reads the
    /// low 5 bits of an index) that picks one field of the index and ignores its other bits, so a field needs no
    /// mask (or shift, when it lies at `shift`); also one half of a `vpermt2w` table with `mask` 31.
    const fn field_table(shift: u32, mask: u32, off: i32) -> [u16; 32] {
        let mut t = [0u16; 32];
        let mut i = 0;
        while i < 32 {
            t[i] = bf16_int((((i as u32) >> shift) & mask) as i32 - off);
            i += 1;
        }
        t
    }
    /// Nibble values 0..15.
    const Q4K_BF16: [u16; 32] = field_table(0, 15, 0);
    /// q2_k's 2-bit quants at bits 0..2 and at bits 2..4 of the index.
    const Q2K_BF16: [[u16; 32]; 2] = [field_table(0, 3, 0), field_table(2, 3, 0)];
    /// `q − 32` for 6-bit `q`: entries 0..32 and 32..64.
    const Q6K_BF16_LO: [u16; 32] = field_table(0, 31, 32);
    const Q6K_BF16_HI: [u16; 32] = field_table(0, 31, 0);

    /// The activations `x[t·ldx + at..at + 32]` of each token as bf16 (the second operand of
    /// `vcvtne2ps2bf16` fills the low half, so element order is kept).
    ///
    /// # Safety
    /// The elements exist.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn load_x_bf16(x: *const f32, at: usize) -> (__m512bh, __m512, __m512) {
        // SAFETY: as documented.
        let (lo, hi) = unsafe { (_mm512_loadu_ps(x.add(at)), _mm512_loadu_ps(x.add(at + 16))) };
        (_mm512_cvtne2ps_pbh(hi, lo), lo, hi)
    }

    /// The 8 sums of 8 vectors, in order (`[Σ s_0, …, Σ s_7]`): halves added, then a tree of horizontal adds.
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    fn sums8(s: &[__m512; 8]) -> __m256 {
        let h = s.map(|v| {
            _mm256_add_ps(
                _mm512_castps512_ps256(v),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
            )
        });
        // [h_a:0-3, h_b:0-3, h_c:0-3, h_d:0-3 | h_a:4-7, h_b:4-7, h_c:4-7, h_d:4-7] for a..d = 0..4, then 4..8.
        let b0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
        let b1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(b0, b1), _mm256_permute2f128_ps::<0x31>(b0, b1))
    }

    /// q4_k with AVX512_BF16; see `qdot::dot_block` and the module documentation.
    ///
    /// Per super-block and row the factors `[d·sc_0..8 | dmin·m_0..8]` are one vector (the f16 `d` and `dmin`
    /// read from a table, as q4_0's scale). The mins' part `Σ_j dmin·m_j·Σx_j` is one FMA a row and super-block
    /// against `[0…0 | Σx_0..8]`, whose 8 sums each token's activations give once for every row of the block;
    /// only the scales' part is per sub-block (a `vdpbf16ps` and an FMA). Measured on the H200 machine's Xeon
    /// (results/exec/bounds/run-q1): 8 FMAs with broadcasts a row and super-block fewer than one per sub-block.
    ///
    /// # Safety
    /// As [`dot_q4_k_avx2`], with AVX-512F/BW/BF16 present.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
    pub unsafe fn dot_q4_k_avx512bf16<const R: usize, const T: usize>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        // SAFETY: the table is 64 bytes.
        let table = unsafe { _mm512_loadu_si512(Q4K_BF16.as_ptr().cast::<__m512i>()) };
        let f16s = f16_to_f32_table().as_ptr();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut mins = [[_mm512_setzero_ps(); T]; R];
        for b in 0..k / 256 {
            let mut fv = [_mm512_setzero_ps(); R];
            let mut f = [[0f32; 16]; R];
            for (r, (fr, v)) in f.iter_mut().zip(&mut fv).enumerate() {
                // SAFETY: super-block b of row r exists; the f16 table has an entry for every 16-bit pattern.
                unsafe {
                    let p = w.add(r * ws + b * Q4K_BYTES);
                    prefetch_block(p, Q4K_BYTES, pf);
                    let sm = q4_k_scales_mins(p.add(4).cast::<[u8; 12]>().read_unaligned());
                    let six = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sm.as_ptr().cast())));
                    let (d, dmin) =
                        (p.cast::<u16>().read_unaligned(), p.add(2).cast::<u16>().read_unaligned());
                    let dd = _mm512_mask_blend_ps(
                        0xff00,
                        _mm512_set1_ps(*f16s.add(usize::from(d))),
                        _mm512_set1_ps(*f16s.add(usize::from(dmin))),
                    );
                    *v = _mm512_mul_ps(six, dd);
                    _mm512_storeu_ps(fr.as_mut_ptr(), *v);
                }
            }
            // Per token, the sums of its 32 activations of sub-block 2c + half (16 lanes each).
            let mut xsum = [[_mm512_setzero_ps(); 8]; T];
            for c in 0..4 {
                // Per token and half: the 32 activations as bf16.
                let mut xt = [[_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), _mm512_setzero_ps()); 2]; T];
                for (t, (v, sums)) in xt.iter_mut().zip(&mut xsum).enumerate() {
                    for (half, vh) in v.iter_mut().enumerate() {
                        // SAFETY: elements 256b + 64c + 32half .. + 32 of token t exist.
                        let (bh, lo, hi) = unsafe { load_x_bf16(x, t * ldx + 256 * b + 64 * c + 32 * half) };
                        *vh = bh;
                        sums[2 * c + half] = _mm512_add_ps(lo, hi);
                    }
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    // SAFETY: nibble chunk c of the super-block (32 bytes).
                    let q = _mm512_cvtepu8_epi16(unsafe {
                        _mm256_loadu_si256(w.add(r * ws + b * Q4K_BYTES + 16 + 32 * c).cast::<__m256i>())
                    });
                    // SAFETY: __m512i and __m512bh are both 512 bits of plain data.
                    let (wlo, whi): (__m512bh, __m512bh) = unsafe {
                        (
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_permutexvar_epi16(q, table)),
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_permutexvar_epi16(
                                _mm512_srli_epi16::<4>(q),
                                table,
                            )),
                        )
                    };
                    for (t, a) in row.iter_mut().enumerate() {
                        for (half, wv) in [wlo, whi].into_iter().enumerate() {
                            let dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), xt[t][half], wv);
                            *a = _mm512_fmadd_ps(dot, _mm512_set1_ps(f[r][2 * c + half]), *a);
                        }
                    }
                }
            }
            for (t, sums) in xsum.iter().enumerate() {
                // [0…0 | Σx_0..8]: the scale lanes of the factors multiply zeros.
                let sx = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                    _mm512_setzero_pd(),
                    _mm256_castps_pd(sums8(sums)),
                ));
                for (m, v) in mins.iter_mut().zip(&fv) {
                    m[t] = _mm512_fmadd_ps(*v, sx, m[t]);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[r][t] = _mm512_reduce_add_ps(acc[r][t]) - _mm512_reduce_add_ps(mins[r][t]);
            }
        }
    }

    /// The packed activations of one q2_k/q3_k super-block, in f32 slots: 8 vectors of 32 bf16 (vector 2j + v,
    /// see [`pack_k23_avx512bf16`]), then, for q2_k, the 16 group sums in order `u`.
    #[must_use]
    pub const fn k23_packed_len(q3: bool) -> usize {
        if q3 { 128 } else { 144 }
    }

    /// For each half `v` of a quarter: the `vpermt2b` index that makes word `w = 8r + 2L + e` of the chunk from
    /// quant byte `16L + 8v + 2r + e` (low byte) and mask byte `(16L + 8v + 2r + e) mod 32` (high byte; the
    /// second source, zero for q2_k). 128-bit row `L = 2n + h` of the 64 quant bytes holds half `n`, lanes
    /// `16h..16h + 16`, so 32-bit lane `u = 4r + L` gets two elements of one group per quarter.
    const K23_QUANT_ORDER: [[u8; 64]; 2] = {
        let mut t = [[0u8; 64]; 2];
        let mut v = 0;
        while v < 2 {
            let mut w = 0;
            while w < 32 {
                let b = 16 * ((w / 2) % 4) + 8 * v + 2 * (w / 8) + w % 2;
                t[v][2 * w] = b as u8;
                t[v][2 * w + 1] = (64 + b % 32) as u8;
                w += 1;
            }
            v += 1;
        }
        t
    };

    /// `vpermb` index that puts group byte `g(u) = 2j + [0, 1, 8, 9][L]` in the low byte of 32-bit lane
    /// `u = 4j + L` (the other bytes are zeroed by the mask `0x1111…`): the groups in the order of
    /// [`K23_QUANT_ORDER`]'s lanes, quarter by quarter.
    const K23_GROUP_ORDER: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut u = 0;
        while u < 16 {
            t[4 * u] = (2 * (u / 4) + [0, 1, 8, 9][u % 4]) as u8;
            u += 1;
        }
        t
    };

    /// q3_k's `q − 4` as a 64-entry `vpermt2w` table (halves 0..32 and 32..64): two low bits at `shift`, the mask
    /// bit at `hbit`.
    const fn q3_k_table(shift: u32, hbit: u32) -> [[u16; 32]; 2] {
        let mut t = [[0u16; 32]; 2];
        let mut i = 0u32;
        while i < 64 {
            let q = ((i >> shift) & 3) + 4 * ((i >> hbit) & 1);
            t[(i / 32) as usize][(i % 32) as usize] = bf16_int(q as i32 - 4);
            i += 1;
        }
        t
    }
    /// q3_k's quarters 0 and 2 (low bits at 0, mask bit at 4) and 1 and 3 (low bits at 2, mask bit at 5).
    const Q3K_BF16: [[[u16; 32]; 2]; 2] = [q3_k_table(0, 4), q3_k_table(2, 5)];

    /// Packs `m` tokens of `k` activations (`x`, stride `k`) for [`dot_k23_avx512bf16`] into `out`
    /// ([`k23_packed_len`] slots a super-block, stride `k / 256 ×` that a token). Vector `2j + v` of a super-block
    /// holds quarter `j`'s elements in the order of `K23_QUANT_ORDER`: 32-bit lane `u = 4r + L` (`L = 2n + h`) the
    /// bf16 of elements `128n + 32j + 16h + 8v + 2r + {0, 1}`. q2_k's group sums `Σx` (of the bf16 values) follow,
    /// group `g(u)` in lane `u` as `K23_GROUP_ORDER` has them.
    ///
    /// # Safety
    /// `x` holds `m × k` f32 and `out` `m × k / 256 × k23_packed_len(Q3)`; `k` is a multiple of 256.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
    pub unsafe fn pack_k23_avx512bf16<const Q3: bool>(x: *const f32, m: usize, k: usize, out: *mut f32) {
        let len = k23_packed_len(Q3);
        // Lane u = 4r + L takes pair r of piece L (whose 4 pairs fill 128-bit lane L after the conversion).
        let transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        // SAFETY: __m512i and __m512bh are both 512 bits of plain data; 0x3f80 is bf16 1.0.
        let ones: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi16(0x3f80)) };
        for t in 0..m {
            for b in 0..k / 256 {
                // SAFETY: super-block b of token t lies in x and its packed slots in out (the sizes documented).
                let (xb, ob) = unsafe { (x.add(t * k + 256 * b), out.add((t * k / 256 + b) * len)) };
                let mut sums = [_mm512_setzero_ps(); 4];
                for (j, s) in sums.iter_mut().enumerate() {
                    for v in 0..2 {
                        // Pieces L = 0..4 (8 elements each) at 128n + 16h + 32j + 8v.
                        let at = 32 * j + 8 * v;
                        // SAFETY: the pieces lie in the super-block, the vector's 64 bytes in its slots;
                        // __m512bh and __m512i are both 512 bits of plain data.
                        let wv = unsafe {
                            let pair = |o: usize| {
                                _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                                    _mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(xb.add(o)))),
                                    _mm256_castps_pd(_mm256_loadu_ps(xb.add(o + 16))),
                                ))
                            };
                            let bf = _mm512_cvtne2ps_pbh(pair(at + 128), pair(at));
                            let wv = _mm512_permutexvar_epi32(
                                transpose,
                                std::mem::transmute::<__m512bh, __m512i>(bf),
                            );
                            _mm512_storeu_si512(ob.add(16 * (2 * j + v)).cast::<__m512i>(), wv);
                            std::mem::transmute::<__m512i, __m512bh>(wv)
                        };
                        if !Q3 {
                            *s = _mm512_dpbf16_ps(*s, wv, ones);
                        }
                    }
                }
                if !Q3 {
                    // Lane u = 4j + L: the sum of sums[j]'s four 128-bit lanes' element L.
                    let fold = |a: __m512, b: __m512| {
                        _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(a, b), _mm512_shuffle_f32x4::<0xee>(a, b))
                    };
                    let (s01, s23) = (fold(sums[0], sums[1]), fold(sums[2], sums[3]));
                    let g = _mm512_add_ps(
                        _mm512_shuffle_f32x4::<0x88>(s01, s23),
                        _mm512_shuffle_f32x4::<0xdd>(s01, s23),
                    );
                    // SAFETY: the 16 slots after the vectors.
                    unsafe { _mm512_storeu_ps(ob.add(128), g) };
                }
            }
        }
    }

    /// q2_k (`Q3` false) or q3_k with AVX512_BF16 and VBMI, on activations packed by [`pack_k23_avx512bf16`]; see
    /// `qdot::dot_block` and the module documentation.
    ///
    /// Per row and half `v` of the quarters, one `vpermt2b` puts the 32 quant bytes (with q3_k's mask bytes as
    /// the words' high bytes) in the packed order, so each 32-bit lane of a `vdpbf16ps` sums two elements of one
    /// group and every quarter's two chunks add into one accumulator. Quarters 0 and 1 index their tables
    /// with the word as is (a table per field position), 2 and 3 after a shift by 4; q3_k first moves each
    /// word's two mask bits next to them (a shift per word by `4 + 4n`, and a bit-select). Per row and
    /// super-block the 4 quarter sums are scaled by `d·sc` of their lanes' groups (four 128-bit broadcasts from
    /// memory) — 4 FMAs where the chunk-by-chunk kernel had 8 — and q2_k's mins `Σ_g dmin·m_g·Σx_g` are one FMA
    /// against the packed group sums. The activations' bf16 conversion, their order and the group sums are
    /// made once per matmul, not once per register block.
    ///
    /// The activations stay bf16 instead of being quantised to 8 bits for integer (VNNI) dot products as ggml
    /// does with q8_K: products of bf16 activations and small-integer quants are exact, so the result stays
    /// dequantise-then-f32 up to the order of additions.
    ///
    /// # Safety
    /// As [`dot_q4_k_avx512bf16`], with AVX512_VBMI present and `x`, `ldx` as [`pack_k23_avx512bf16`] made
    /// them (`ldx` in f32 slots).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512bf16,avx2,fma,f16c")]
    pub unsafe fn dot_k23_avx512bf16<const R: usize, const T: usize, const Q3: bool>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        let (bb, quants_at) = if Q3 { (Q3K_BYTES, 32) } else { (Q2K_BYTES, 16) };
        let len = k23_packed_len(Q3);
        // SAFETY: each index and table is 64 bytes.
        let load = |p: *const u8| unsafe { _mm512_loadu_si512(p.cast::<__m512i>()) };
        let order = K23_QUANT_ORDER.map(|o| load(o.as_ptr()));
        let group_order = load(K23_GROUP_ORDER.as_ptr());
        let tables = if Q3 {
            Q3K_BF16.map(|t| t.map(|h| load(h.as_ptr().cast())))
        } else {
            Q2K_BF16.map(|h| [load(h.as_ptr().cast()); 2])
        };
        // A quarter's bf16 quants from its index (q3_k: 6 bits, two tables; q2_k: 5 bits).
        let lookup = |idx: __m512i, t: &[__m512i; 2]| -> __m512bh {
            let v = if Q3 {
                _mm512_permutex2var_epi16(t[0], idx, t[1])
            } else {
                _mm512_permutexvar_epi16(idx, t[0])
            };
            // SAFETY: __m512i and __m512bh are both 512 bits of plain data.
            unsafe { std::mem::transmute(v) }
        };
        // q3_k: per word (lane u = 4r + L, half n = L / 2), the shift that brings mask bits 4n, 4n + 1 of the high
        // byte to bits 4, 5.
        let mask_shift = _mm512_broadcast_i32x4(_mm_setr_epi16(4, 4, 4, 4, 8, 8, 8, 8));
        let low4 = _mm512_set1_epi16(0x0f);
        let f16s = f16_to_f32_table().as_ptr();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for b in 0..k / 256 {
            // Per row: d·sc of the 16 groups in order u (stored for all rows first, so that no load waits for its
            // store), and q2_k's mins.
            let mut ds = [[0f32; 16]; R];
            for (r, (row, dr)) in acc.iter_mut().zip(&mut ds).enumerate() {
                // SAFETY: super-block b of row r exists.
                let p = unsafe { w.add(r * ws + b * bb) };
                prefetch_block(p, bb, pf);
                // SAFETY: the f16 table has an entry for every 16-bit pattern; the f16 lies in the block.
                let f16_at = |at: usize| unsafe {
                    _mm512_set1_ps(*f16s.add(usize::from(p.add(at).cast::<u16>().read_unaligned())))
                };
                // SAFETY: the scale bytes, the packed group sums of every token, and dr's 16 f32.
                unsafe {
                    let bytes = if Q3 {
                        let sc = q3_k_scales_words(p.add(96).cast::<[u8; 12]>().read_unaligned());
                        _mm_loadu_si128(sc.as_ptr().cast::<__m128i>())
                    } else {
                        _mm_loadu_si128(p.cast::<__m128i>())
                    };
                    let sm = _mm512_maskz_permutexvar_epi8(
                        0x1111_1111_1111_1111,
                        group_order,
                        _mm512_castsi128_si512(bytes),
                    );
                    let v = if Q3 {
                        _mm512_mul_ps(
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(sm, _mm512_set1_epi32(32))),
                            f16_at(108),
                        )
                    } else {
                        let mins = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(sm)), f16_at(82));
                        for (t, a) in row.iter_mut().enumerate() {
                            *a = _mm512_fnmadd_ps(mins, _mm512_loadu_ps(x.add(t * ldx + b * len + 128)), *a);
                        }
                        _mm512_mul_ps(
                            _mm512_cvtepi32_ps(_mm512_and_si512(sm, _mm512_set1_epi32(0x0f))),
                            f16_at(80),
                        )
                    };
                    _mm512_storeu_ps(dr.as_mut_ptr(), v);
                }
            }
            // Opaque to the optimiser, so that the scales below stay 128-bit broadcasts from memory (load ports)
            // instead of becoming shuffles of the stored vectors (LLVM's choice otherwise): 4 more shuffles a row
            // and super-block on the Xeon's one 512-bit shuffle port, which the lookups fill. No different on the
            // 2-core EPYC (Zen 5), where it was measured.
            let ds = std::hint::black_box(&ds);
            for (r, (row, ds)) in acc.iter_mut().zip(ds).enumerate() {
                // SAFETY: super-block b of row r exists: its 64 quant bytes, and q3_k's 32 mask bytes.
                let (q, h) = unsafe {
                    let p = w.add(r * ws + b * bb);
                    let h = if Q3 {
                        _mm512_castsi256_si512(_mm256_loadu_si256(p.cast::<__m256i>()))
                    } else {
                        _mm512_setzero_si512()
                    };
                    (_mm512_loadu_si512(p.add(quants_at).cast::<__m512i>()), h)
                };
                // Per half v: the indices of quarters 0, 1 and of quarters 2, 3.
                let idx = order.map(|o| {
                    let wv = _mm512_permutex2var_epi8(q, o, h);
                    if Q3 {
                        let hb = _mm512_srlv_epi16(wv, mask_shift);
                        [
                            _mm512_ternarylogic_epi32::<0xca>(low4, wv, hb),
                            _mm512_ternarylogic_epi32::<0xca>(
                                low4,
                                _mm512_srli_epi16::<4>(wv),
                                _mm512_srli_epi16::<2>(hb),
                            ),
                        ]
                    } else {
                        [wv, _mm512_srli_epi16::<4>(wv)]
                    }
                });
                for j in 0..4 {
                    // Per token: lane u's Σ x·q over both halves (groups g(u) of quarter j).
                    let mut sums = [_mm512_setzero_ps(); T];
                    for (v, iv) in idx.iter().enumerate() {
                        let qv = lookup(iv[j / 2], &tables[j % 2]);
                        for (t, s) in sums.iter_mut().enumerate() {
                            // SAFETY: vector 2j + v of super-block b of token t (packed: 64 bytes).
                            let xv: __m512bh = unsafe {
                                std::mem::transmute(_mm512_loadu_si512(
                                    x.add(t * ldx + b * len + 16 * (2 * j + v)).cast::<__m512i>(),
                                ))
                            };
                            *s = _mm512_dpbf16_ps(*s, xv, qv);
                        }
                    }
                    // SAFETY: 4j + 4 ≤ 16, inside ds.
                    let scale = _mm512_broadcast_f32x4(unsafe { _mm_loadu_ps(ds.as_ptr().add(4 * j)) });
                    for (a, s) in row.iter_mut().zip(sums) {
                        *a = _mm512_fmadd_ps(s, scale, *a);
                    }
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
            }
        }
    }

    /// q6_k with AVX512_BF16; see `qdot::dot_block` and the module documentation.
    ///
    /// # Safety
    /// As [`dot_q4_k_avx512bf16`].
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
    pub unsafe fn dot_q6_k_avx512bf16<const R: usize, const T: usize>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        // SAFETY: each table is 64 bytes.
        let (tlo, thi) = unsafe {
            (
                _mm512_loadu_si512(Q6K_BF16_LO.as_ptr().cast::<__m512i>()),
                _mm512_loadu_si512(Q6K_BF16_HI.as_ptr().cast::<__m512i>()),
            )
        };
        let (m4, m30) = (_mm512_set1_epi16(0x0f), _mm512_set1_epi16(0x30));
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for b in 0..k / 256 {
            // Per row, d·scale for the 16 groups (lane g).
            let mut ds = [_mm512_setzero_ps(); R];
            for (r, dr) in ds.iter_mut().enumerate() {
                // SAFETY: super-block b of row r exists.
                unsafe {
                    let p = w.add(r * ws + b * Q6K_BYTES);
                    prefetch_block(p, Q6K_BYTES, pf);
                    let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                        p.add(192).cast::<__m128i>(),
                    )));
                    *dr = _mm512_mul_ps(sc, _mm512_set1_ps(f16(p, 208)));
                }
            }
            for h in 0..2 {
                // Quarter c of this half, per token: its 32 activations as bf16.
                let mut xq = [[_mm512_cvtne2ps_pbh(_mm512_setzero_ps(), _mm512_setzero_ps()); 4]; T];
                for (t, v) in xq.iter_mut().enumerate() {
                    for (c, vc) in v.iter_mut().enumerate() {
                        // SAFETY: elements 256b + 128h + 32c .. + 32 of token t exist.
                        *vc = unsafe { load_x_bf16(x, t * ldx + 256 * b + 128 * h + 32 * c).0 };
                    }
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    // SAFETY: the half's 64 low-nibble bytes and 32 high-pair bytes.
                    let (a0, a1, q) = unsafe {
                        let p = w.add(r * ws + b * Q6K_BYTES);
                        (
                            _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(64 * h).cast::<__m256i>())),
                            _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(64 * h + 32).cast::<__m256i>())),
                            _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(128 + 32 * h).cast::<__m256i>())),
                        )
                    };
                    // 6-bit indices of quarters 0..3: low or high nibble, high pair at bits 4..6.
                    let idx = [
                        _mm512_or_si512(
                            _mm512_and_si512(a0, m4),
                            _mm512_and_si512(_mm512_slli_epi16::<4>(q), m30),
                        ),
                        _mm512_or_si512(
                            _mm512_and_si512(a1, m4),
                            _mm512_and_si512(_mm512_slli_epi16::<2>(q), m30),
                        ),
                        _mm512_or_si512(_mm512_srli_epi16::<4>(a0), _mm512_and_si512(q, m30)),
                        _mm512_or_si512(
                            _mm512_srli_epi16::<4>(a1),
                            _mm512_and_si512(_mm512_srli_epi16::<2>(q), m30),
                        ),
                    ];
                    for (c, ix) in idx.into_iter().enumerate() {
                        // SAFETY: __m512i and __m512bh are both 512 bits of plain data.
                        let wv: __m512bh =
                            unsafe { std::mem::transmute(_mm512_permutex2var_epi16(tlo, ix, thi)) };
                        // Lanes 0..8 sum elements 0..16 (group 8h + 2c), lanes 8..16 the next 16.
                        let g = (8 * h + 2 * c) as i32;
                        let scale = _mm512_permutexvar_ps(
                            _mm512_setr_epi32(
                                g,
                                g,
                                g,
                                g,
                                g,
                                g,
                                g,
                                g,
                                g + 1,
                                g + 1,
                                g + 1,
                                g + 1,
                                g + 1,
                                g + 1,
                                g + 1,
                                g + 1,
                            ),
                            ds[r],
                        );
                        for (t, a) in row.iter_mut().enumerate() {
                            *a = _mm512_fmadd_ps(
                                _mm512_dpbf16_ps(_mm512_setzero_ps(), xq[t][c], wv),
                                scale,
                                *a,
                            );
                        }
                    }
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::qdot::{CacheLevel, Prefetch, dot_block, pack_x};
    use super::super::simd::{Isa, detect};
    use crate::quant::{QFormat, q3_k_scales, q4_k_scale_min};

    /// Bytes from a 64-bit LCG (every bit pattern, deterministic).
    fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                (s >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn q3_k_scales_unpack_as_the_reference_reads_them() {
        for packed in random_bytes(64 * 12, 3).chunks_exact(12).chain([[0u8; 12].as_slice(), &[0xff; 12]]) {
            assert_eq!(super::q3_k_scales_words(packed.try_into().unwrap()), q3_k_scales(packed));
        }
    }

    /// `R` rows × `T` tokens of `fmt` through `dot_block` with `isa`, against dequantise-then-f64: the error
    /// may be that of f32 additions, relative to `Σ |x·w|` (the mins may cancel the rest).
    fn check_dot<const R: usize, const T: usize>(isa: Isa, fmt: QFormat, w: &[u8], x: &[f32], k: usize) {
        let rb = fmt.row_bytes(k);
        let deq = fmt.dequantize(&w[..R * rb]);
        let mut got = [[0f32; T]; R];
        let pf = Prefetch { bytes: 256, level: CacheLevel::L1 };
        let packed = pack_x(isa, fmt, x, T, k);
        let (xp, ldx) = packed.as_ref().map_or((x.as_ptr(), k), |(p, ld)| (p.as_ptr(), *ld));
        // SAFETY: w holds R rows of rb bytes, x holds T rows of k (or pack_x's rows); `isa` is this machine's or
        // weaker.
        unsafe { dot_block::<R, T>(isa, fmt, pf, xp, ldx, w.as_ptr(), rb, k, &mut got) };
        for (r, row) in got.iter().enumerate() {
            for (t, &g) in row.iter().enumerate() {
                let terms = x[t * k..(t + 1) * k].iter().zip(&deq[r * k..(r + 1) * k]);
                let (want, scale) = terms.fold((0f64, 0f64), |(s, a), (&xi, &wi)| {
                    let p = f64::from(xi) * f64::from(wi);
                    (s + p, a + p.abs())
                });
                assert!(
                    (f64::from(g) - want).abs() <= 1e-5 * scale + 1e-30,
                    "{isa:?} {fmt:?} {R}x{T} row {r} token {t}: {g} vs {want} (Σ|x·w| {scale})"
                );
            }
        }
    }

    /// Every ISA path (AVX512_BF16, AVX-512 and AVX2 where present, plain Rust) on random q2_k and q3_k
    /// super-blocks: random quants, scales and mask bits, with `d` and `dmin` drawn from edge values (zero,
    /// subnormal, ±65504, negative), some blocks with all scale bytes zero (q3_k: every scale −32), and some
    /// q2_k blocks with every min at 15.
    #[test]
    fn k23_dot_products_agree_on_every_isa_with_edge_blocks() {
        let edges = [0.0f32, 6.0e-8, 1.0, -0.37, 65504.0, -65504.0, 3.1e-3];
        let k = 1024;
        let x: Vec<f32> = random_bytes(4 * k * 2, 7)
            .chunks_exact(2)
            .map(|b| half::bf16::from_f32(f32::from(i16::from_le_bytes([b[0], b[1]])) / 16384.0).to_f32())
            .collect();
        let isas = detect().and_weaker();
        assert!(isas.contains(&Isa::Portable));
        for (fmt, bb, d_at) in [(QFormat::Q2K, 84, 80), (QFormat::Q3K, 110, 108)] {
            let mut w = random_bytes(8 * k / 256 * bb, bb as u64);
            for (i, blk) in w.chunks_exact_mut(bb).enumerate() {
                let d = half::f16::from_f32(edges[i % edges.len()]).to_le_bytes();
                blk[d_at..d_at + 2].copy_from_slice(&d);
                if fmt == QFormat::Q2K {
                    let dmin = half::f16::from_f32(edges[(i * 3 + 1) % edges.len()]).to_le_bytes();
                    blk[82..84].copy_from_slice(&dmin);
                }
                match (fmt, i % 5) {
                    (QFormat::Q2K, 1) => blk[..16].fill(0),
                    (QFormat::Q2K, 2) => blk[..16].iter_mut().for_each(|s| *s |= 0xf0),
                    (QFormat::Q3K, 1) => blk[96..108].fill(0),
                    _ => {}
                }
            }
            for &isa in &isas {
                check_dot::<8, 1>(isa, fmt, &w, &x, k);
                check_dot::<4, 4>(isa, fmt, &w, &x, k);
                check_dot::<1, 4>(isa, fmt, &w[2 * fmt.row_bytes(k)..], &x, k);
                check_dot::<1, 1>(isa, fmt, &w[5 * fmt.row_bytes(k)..], &x, k);
            }
        }
    }

    /// The packed activations of the q2_k/q3_k AVX512_BF16 kernel: every element's bf16 once, at the place the
    /// layout documented on `pack_k23_avx512bf16` gives it, and q2_k's group sums; no packing on weaker ISAs.
    #[test]
    fn k23_packed_activations_hold_every_element_in_lane_order_and_the_group_sums() {
        let (m, k) = (3, 512);
        let x: Vec<f32> = random_bytes(m * k * 4, 11)
            .chunks_exact(4)
            .map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])) / f32::from(1 + u16::from(b[2] >> 3)))
            .collect();
        for fmt in [QFormat::Q2K, QFormat::Q3K] {
            for isa in detect().and_weaker() {
                let packed = pack_x(isa, fmt, &x, m, k);
                if isa < Isa::Avx512Bf16 {
                    assert!(packed.is_none(), "{isa:?} {fmt:?} reads the f32 rows");
                    continue;
                }
                let (p, ld) = packed.expect("the AVX512_BF16 kernel packs q2_k and q3_k activations");
                let per_block = if fmt == QFormat::Q2K { 144 } else { 128 };
                assert_eq!((ld, p.len()), (k / 256 * per_block, m * ld));
                for t in 0..m {
                    for b in 0..k / 256 {
                        let slots = &p[t * ld + b * per_block..][..per_block];
                        let xb = &x[t * k + 256 * b..][..256];
                        let mut seen = [false; 256];
                        for (jv, vector) in slots[..128].chunks_exact(16).enumerate() {
                            let (j, v) = (jv / 2, jv % 2);
                            for (u, slot) in vector.iter().enumerate() {
                                let (r, l) = (u / 4, u % 4);
                                let bits = slot.to_bits();
                                for (e, half) in [bits & 0xffff, bits >> 16].into_iter().enumerate() {
                                    let at = 128 * (l / 2) + 32 * j + 16 * (l % 2) + 8 * v + 2 * r + e;
                                    assert_eq!(
                                        half,
                                        u32::from(half::bf16::from_f32(xb[at]).to_bits()),
                                        "{at}"
                                    );
                                    seen[at] = true;
                                }
                            }
                        }
                        assert!(seen.iter().all(|&s| s));
                        if fmt == QFormat::Q2K {
                            for (u, &sum) in slots[128..].iter().enumerate() {
                                let g = 2 * (u / 4) + [0, 1, 8, 9][u % 4];
                                let want: f64 = xb[16 * g..16 * g + 16]
                                    .iter()
                                    .map(|&v| f64::from(half::bf16::from_f32(v)))
                                    .sum();
                                let scale: f64 =
                                    xb[16 * g..16 * g + 16].iter().map(|v| f64::from(v.abs())).sum();
                                assert!(
                                    (f64::from(sum) - want).abs() <= 1e-6 * scale,
                                    "group {g}: {sum} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn q4_k_scales_unpack_as_the_reference_reads_them() {
        // Random packed bytes (every bit pattern matters, the top bits included), then real blocks.
        let mut blocks: Vec<u8> =
            (0..64 * 144u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let x: Vec<f32> =
            (0..2048).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1 + i / 256) as f32).collect();
        blocks.extend(QFormat::Q4K.quantize(&x, 256));
        for b in blocks.chunks_exact(144) {
            let got = super::q4_k_scales_mins(b[4..16].try_into().unwrap());
            for j in 0..8 {
                assert_eq!((got[j], got[8 + j]), q4_k_scale_min(j, &b[4..16]), "sub-block {j}");
            }
        }
    }
}
