//! SIMD inner loops of the CPU matmul on K-quant rows (q2_k, q3_k, q4_k, q6_k): f32 activations against
//! 256-element super-blocks, for [`super::qdot::dot_block`].
//!
//! Per super-block and row the scales are decoded once into f32 (q4_k: `d·sc` and `dmin·m` per sub-block of
//! 32; q6_k: `d·scale` per group of 16; q2_k: `d·sc` and `dmin·m` per 16; q3_k: `d·(sc − 32)` per 16), then
//! each sub-block adds `d·sc·Σ x·q − dmin·m·Σ x` (q2_k, q4_k) or `d·scale·Σ x·q` (q3_k, q6_k, signed quants)
//! to the row's accumulator. The activation loads, their bf16 conversion and the sums `Σ x` are shared by the
//! rows of a register block. The result equals dequantise-then-f32 up to the order and rounding of f32
//! additions, as for q4_0, with q2_k's and q3_k's activations first rounded to 8 bits per super-block
//! (`quant::round_activations`; `qdot::pack_x` hands these kernels the rounded values as f32).
//!
//! With AVX512_BF16 the q4_k and q6_k quants become bf16, exact as small integers, and `vdpbf16ps` multiplies
//! them with the activations (bf16 values already, so exact too): q4_k's nibble `q`, shifted to the top 4
//! mantissa bits under the exponent of 16, is the bf16 value `16 + q` (a shift and a bit-select, no shuffle),
//! and the offset `16·Σx` of each sub-block joins the mins' part; q6_k's 6-bit values go through `vpermt2w`, a
//! 64-entry table of `q − 32`. Their activations are converted to bf16 once per matmul ([`pack_k_bf16`], with
//! q4_k's sub-block sums, in the order of q6_k's lanes), not for every register block of rows. Other x86
//! machines with AVX2+FMA (AVX-512 ones without BF16 included) widen the quants to f32 and use FMAs.
//!
//! q2_k and q3_k on those AVX512_BF16 machines (all of which have AVX512_VBMI and AVX512_VNNI) do what ggml
//! does with q8_K: the activations are quantised once per matmul to `i8` against each super-block's largest
//! magnitude ([`pack_k23_vnni`]), `vpermb` lookups turn the 2- and 3-bit quants into bytes, and `vpdpbusd`
//! multiplies them in integers. Per row and super-block that is 25 vector µops for q2_k and 30 for q3_k
//! against 33 and about 42 for the bf16 kernels they replace, which were bound by the Xeon's vector ports
//! (results/exec/quant, session 11); on this repository's 2-core Zen 5, 1.28× and 1.23× per core. Each
//! activation moves by up to half its super-block's step `max |x| / 127` (about 0.5 % of a GEMV's output on
//! Gaussian activations), so that rounding is part of the q2_k/q3_k GEMV's function everywhere: the f32
//! kernels above and the GPU's GEMV round the activations the same way, bit for bit, and all paths again
//! differ only in the order of f32 operations.

#[cfg(target_arch = "x86_64")]
pub use x86::{
    K23_VNNI_SLOTS, Q4K_BF16_SLOTS, Q6K_BF16_SLOTS, dot_k23_avx2, dot_q2_k_vnni, dot_q3_k_vnni,
    dot_q4_k_avx2, dot_q4_k_avx512bf16, dot_q6_k_avx2, dot_q6_k_avx512bf16, pack_k_bf16, pack_k23_vnni,
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

#[cfg(target_arch = "x86_64")]
#[allow(clippy::cast_ptr_alignment)] // every vector load here is `loadu`, which takes any alignment
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256, __m256i, __m512, __m512bh, __m512i, _MM_HINT_T0, _MM_HINT_T1, _mm_cvtsi32_si128,
        _mm_loadu_si128, _mm_prefetch, _mm_setr_epi32, _mm_srli_si128, _mm_storeu_si128, _mm256_add_ps,
        _mm256_and_si256, _mm256_castpd_ps, _mm256_castsi256_si128, _mm256_cvtepi8_epi32, _mm256_cvtepi32_ps,
        _mm256_cvtepu8_epi32, _mm256_extracti128_si256, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_hadd_ps,
        _mm256_loadu_ps, _mm256_loadu_si256, _mm256_mul_ps, _mm256_or_si256, _mm256_permute2f128_ps,
        _mm256_set1_epi8, _mm256_set1_ps, _mm256_setzero_ps, _mm256_slli_epi16, _mm256_srl_epi16,
        _mm256_srli_epi16, _mm256_storeu_ps, _mm256_sub_epi8, _mm512_abs_ps, _mm512_add_epi32, _mm512_add_ps,
        _mm512_and_si512, _mm512_broadcast_i32x4, _mm512_broadcast_i64x4, _mm512_castps_pd,
        _mm512_castps512_ps256, _mm512_castsi128_si512, _mm512_cvtepi8_epi32, _mm512_cvtepi32_ps,
        _mm512_cvtepu8_epi32, _mm512_cvtne2ps_pbh, _mm512_cvtps_epi32, _mm512_cvtsepi32_epi8,
        _mm512_dpbf16_ps, _mm512_dpbusd_epi32, _mm512_dpwssds_epi32, _mm512_extractf64x4_pd, _mm512_fmadd_ps,
        _mm512_fmsub_ps, _mm512_loadu_ps, _mm512_loadu_si512, _mm512_madd_epi16, _mm512_mask_blend_ps,
        _mm512_mask_srli_epi16, _mm512_maskz_permutexvar_epi8, _mm512_max_ps, _mm512_mul_ps,
        _mm512_permutex2var_epi8, _mm512_permutex2var_epi16, _mm512_permutexvar_epi8, _mm512_permutexvar_ps,
        _mm512_reduce_add_ps, _mm512_reduce_max_ps, _mm512_rolv_epi32, _mm512_set1_epi8, _mm512_set1_epi16,
        _mm512_set1_epi32, _mm512_set1_ps, _mm512_setr_epi32, _mm512_setzero_ps, _mm512_setzero_si512,
        _mm512_slli_epi16, _mm512_srli_epi16, _mm512_srli_epi32, _mm512_srlv_epi32, _mm512_storeu_si512,
        _mm512_sub_epi16, _mm512_ternarylogic_epi32,
    };

    use super::super::qdot::{CacheLevel, Prefetch, f16_to_f32_table};
    use super::q4_k_scales_mins;

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

    /// bf16 bit patterns of `i − off` for `i` in 0..32: one half of a `vpermt2w` table.
    const fn int_table(off: i32) -> [u16; 32] {
        let mut t = [0u16; 32];
        let mut i = 0;
        while i < 32 {
            t[i] = bf16_int(i as i32 - off);
            i += 1;
        }
        t
    }
    /// `q − 32` for 6-bit `q`: entries 0..32 and 32..64.
    const Q6K_BF16_LO: [u16; 32] = int_table(32);
    const Q6K_BF16_HI: [u16; 32] = int_table(0);

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

    /// q4_k with AVX512_BF16 on activations packed by [`pack_k_bf16`]; see `qdot::dot_block` and the module
    /// documentation.
    ///
    /// Per super-block and row the factors `[d·sc_0..8 | dmin·m_0..8]` are one vector (the f16 `d` and `dmin`
    /// read from a table, as q4_0's scale). The nibbles come as 16-bit lanes of two 64-byte loads (no widening):
    /// lane `l` holds bytes `2l`, `2l + 1` of chunks `2p` and `2p + 1` (below and from lane 16), 4 nibbles, which
    /// a shift and a bit-select each turn into the bf16 values `16 + q`; the packed activations are in that
    /// order. Two `vdpbf16ps` chained (the low nibbles of the even and the odd bytes; then the high ones) give
    /// f32 lanes of sub-blocks `4p + j` (lanes 0..8) and `4p + 2 + j` (8..16), and one FMA by those lanes of
    /// the factors (a `vpermps`) adds them. The rest, `Σ_j (16·d·sc_j + dmin·m_j)·Σx_j`, is one FMA a row and
    /// super-block against the packed `[16·Σx_0..8 | Σx_0..8]`. Measured on the H200 machine's Xeon
    /// (results/exec/bounds/run-q1): 8 FMAs with broadcasts a row and super-block fewer than one per
    /// sub-block.
    ///
    /// Per row and super-block: 37 vector µops (4 for the factors; per 64 bytes 4 shifts, 4 bit-selects, 2
    /// `vpermps`, 4 `vdpbf16ps` and 2 FMAs; the mins' FMA), 5 of them on the shuffle port, against 37 with 13 for
    /// the kernel it replaced (a `vpmovzxbw` per 32 bytes and a `vpermw` lookup per 32 nibbles), which also
    /// converted and summed the activations for every register block of rows (about 40 µops a token and
    /// super-block, 20 on the shuffle port). On this repository's 2-core Zen 5, 1.14–1.27× per core
    /// (results/exec/quant, session 17). The offset makes the sums `Σ x·(16 + q)` about 3 times larger than
    /// `Σ x·q`, and so their f32 rounding (the bench's largest relative error on q4_k: 2.3e-7 against 2.0e-7).
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
        // Per pair j of dot products over nibble chunks 2p, 2p + 1: the factor lanes of their sub-blocks.
        let sub_blocks: [__m512i; 4] = std::array::from_fn(|i| {
            let (a, c) = (4 * (i / 2) + i % 2, 4 * (i / 2) + 2 + i % 2);
            let (a, c) = (a as i32, c as i32);
            _mm512_setr_epi32(a, a, a, a, a, a, a, a, c, c, c, c, c, c, c, c)
        });
        let (field, sixteen) = (_mm512_set1_epi16(0x78), _mm512_set1_epi16(bf16_int(16).cast_signed()));
        let f16s = f16_to_f32_table().as_ptr();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut mins = [[_mm512_setzero_ps(); T]; R];
        for b in 0..k / 256 {
            let mut fv = [_mm512_setzero_ps(); R];
            for (r, v) in fv.iter_mut().enumerate() {
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
                }
            }
            for p in 0..2 {
                for (r, row) in acc.iter_mut().enumerate() {
                    // SAFETY: nibble chunks 2p and 2p + 1 of the super-block (64 bytes).
                    let v = unsafe { _mm512_loadu_si512(w.add(r * ws + b * Q4K_BYTES + 16 + 64 * p).cast()) };
                    // A nibble at bits 3..6, the top 4 bits of a bf16 mantissa below the exponent of 16.
                    let as_bf16 = |u: __m512i| {
                        // SAFETY: __m512i and __m512bh are both 512 bits of plain data.
                        unsafe {
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_ternarylogic_epi32::<0xea>(
                                field, u, sixteen,
                            ))
                        }
                    };
                    // Lane l holds bytes 2l, 2l + 1 (chunk 2p below lane 16, 2p + 1 from it): their low nibbles
                    // (sub-blocks 4p, 4p + 2), then their high nibbles (4p + 1, 4p + 3).
                    let wv = [
                        as_bf16(_mm512_slli_epi16::<3>(v)),
                        as_bf16(_mm512_srli_epi16::<5>(v)),
                        as_bf16(_mm512_srli_epi16::<1>(v)),
                        as_bf16(_mm512_srli_epi16::<9>(v)),
                    ];
                    // Lanes 0..8 scale by sub-block 4p + j, lanes 8..16 by 4p + 2 + j.
                    let scale = [0, 1].map(|j| _mm512_permutexvar_ps(sub_blocks[2 * p + j], fv[r]));
                    for (t, a) in row.iter_mut().enumerate() {
                        // SAFETY: token t's packed super-block b exists; __m512i and __m512bh are both 512 bits
                        // of plain data.
                        let xv: [__m512bh; 4] = std::array::from_fn(|i| unsafe {
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                                x.add(t * ldx + b * Q4K_BF16_SLOTS + 64 * p + 16 * i).cast(),
                            ))
                        });
                        for j in 0..2 {
                            let dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), xv[2 * j], wv[2 * j]);
                            let dot = _mm512_dpbf16_ps(dot, xv[2 * j + 1], wv[2 * j + 1]);
                            *a = _mm512_fmadd_ps(dot, scale[j], *a);
                        }
                    }
                }
            }
            for t in 0..T {
                // SAFETY: token t's packed super-block b exists.
                let sx = unsafe { _mm512_loadu_ps(x.add(t * ldx + b * Q4K_BF16_SLOTS + 128)) };
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

    /// The element of a q4_k super-block at bf16 slot `i` of [`pack_k_bf16`]: per 128 (`p`), four runs of 32
    /// in the order of the kernel's nibble fields (the low nibbles of even bytes, of odd bytes, the high nibbles
    /// of even bytes, of odd bytes), lane `l` of a run holding byte `2·(l mod 16)` (+ 1) of chunk
    /// `2p + l / 16`.
    const fn q4_k_element(i: usize) -> usize {
        let (p, field, l) = (i / 128, (i / 32) % 4, i % 32);
        64 * (2 * p + l / 16) + 32 * (field / 2) + 2 * (l % 16) + field % 2
    }

    /// The element of a q6_k super-block at bf16 slot `i` of [`pack_k_bf16`]: per 64, the even elements, then
    /// the odd ones.
    const fn q6_k_element(i: usize) -> usize {
        64 * (i / 64) + 2 * (i % 32) + (i / 32) % 2
    }

    /// f32 slots of one token's super-block as [`pack_k_bf16`] packs it for q4_k: 256 bf16 (128 slots), then
    /// `[16·Σx_0..8 | Σx_0..8]`.
    pub const Q4K_BF16_SLOTS: usize = 144;
    /// The same for q6_k: 256 bf16.
    pub const Q6K_BF16_SLOTS: usize = 128;

    /// Packs `m` tokens of `k` activations (`x`, stride `k`) for [`dot_q4_k_avx512bf16`] (`q6` false) or
    /// [`dot_q6_k_avx512bf16`], [`Q4K_BF16_SLOTS`] or [`Q6K_BF16_SLOTS`] a super-block: the activations as bf16
    /// (rounded to nearest even, as `vcvtne2ps2bf16` rounds; exact for the bf16 values every matmul input
    /// holds), in the order of the kernel's 16-bit lanes (`q4_k_element`, `q6_k_element`); for q4_k then, per
    /// sub-block `j` of 32, the sum `Σx_j` of the f32 values, times 16 (the offset of the kernel's quants) and
    /// as it is (for the mins).
    /// Once per matmul, so that no register block of rows converts (and sums) them again.
    ///
    /// # Safety
    /// AVX-512F/BW and AVX512_BF16 are present.
    #[must_use]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2")]
    pub unsafe fn pack_k_bf16(x: &[f32], m: usize, k: usize, q6: bool) -> Vec<f32> {
        let slots = if q6 { Q6K_BF16_SLOTS } else { Q4K_BF16_SLOTS };
        let mut out = vec![0f32; m * k / 256 * slots];
        for (xb, ob) in x[..m * k].chunks_exact(256).zip(out.chunks_exact_mut(slots)) {
            let order: [f32; 256] =
                std::array::from_fn(|i| xb[if q6 { q6_k_element(i) } else { q4_k_element(i) }]);
            let mut sums = [_mm512_setzero_ps(); 8];
            for (j, sum) in sums.iter_mut().enumerate() {
                // SAFETY: 32 f32 at 32j of `order` and of xb, and their 16 slots of ob.
                unsafe {
                    let (bh, _, _) = load_x_bf16(order.as_ptr(), 32 * j);
                    _mm512_storeu_si512(
                        ob.as_mut_ptr().add(16 * j).cast(),
                        std::mem::transmute::<__m512bh, __m512i>(bh),
                    );
                    let (_, lo, hi) = load_x_bf16(xb.as_ptr(), 32 * j);
                    *sum = _mm512_add_ps(lo, hi);
                }
            }
            if !q6 {
                let s = sums8(&sums);
                // SAFETY: slots 128..144 of ob.
                unsafe {
                    _mm256_storeu_ps(ob.as_mut_ptr().add(128), _mm256_mul_ps(s, _mm256_set1_ps(16.0)));
                    _mm256_storeu_ps(ob.as_mut_ptr().add(136), s);
                }
            }
        }
        out
    }

    /// f32 slots of one token's super-block as [`pack_k23_vnni`] packs it: 4 vectors of 64 `i8` (256 bytes),
    /// 16 group-sum dwords, the f32 scale `dx`, 3 slots of padding.
    pub const K23_VNNI_SLOTS: usize = 84;

    /// The element that byte `pos` of quarter `j`'s packed vector holds. A quarter's 64 elements are field `j`
    /// of the 64 quant bytes (q2_k's, q3_k's low bits), which `K23_QUANT_ORDER` reorders: byte
    /// `pos = 16r + 4L + e` (dword `u = 4r + L`) takes quant byte `32n + 16h + 4r + e` with `L = 2n + h`, whose
    /// field `j` is element `128n + 32j + 16h + 4r + e`, of group `8n + 2j + h`. So each dword holds 4 elements
    /// of one group, and every 128-bit lane the same four groups, `2j + [0, 1, 8, 9][L]`.
    const fn k23_element(j: usize, pos: usize) -> usize {
        let (r, l, e) = (pos / 16, (pos / 4) % 4, pos % 4);
        128 * (l / 2) + 32 * j + 16 * (l % 2) + 4 * r + e
    }

    /// `vpermb` index of the reorder: to byte `pos` the quant byte that holds `k23_element(0, pos)` (q3_k's 32
    /// mask bytes, loaded into both halves, alike: mask byte `l` serves elements `l + 32i`).
    const K23_QUANT_ORDER: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut pos = 0;
        while pos < 64 {
            let e = k23_element(0, pos);
            t[pos] = (32 * (e / 128) + e % 32) as u8;
            pos += 1;
        }
        t
    };

    /// Group `g(u) = 2j + [0, 1, 8, 9][L]` of dword `u = 4j + L`: the groups of quarter `j`'s dword lanes `L`
    /// (each 128-bit lane), in the order of the packed group sums.
    const fn k23_group(u: usize) -> usize {
        2 * (u / 4) + [0, 1, 8, 9][u % 4]
    }

    /// q2_k: `vpermb` index that puts 4 copies of group `g(u)`'s scale byte in dword `u`, so that 128-bit lane
    /// `j` is quarter `j`'s scales for its reordered quants.
    const Q2K_SCALE_ORDER: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut pos = 0;
        while pos < 64 {
            t[pos] = k23_group(pos / 4) as u8;
            pos += 1;
        }
        t
    };

    /// q3_k: `vpermb` index that gathers, for dword `u`, the two packed scale bytes of group `g = g(u)` (read
    /// from 2 bytes before them, so that the 16-byte load stays inside the super-block): byte 0 holds its low 4
    /// bits (byte `g mod 8`, high nibble when `g ≥ 8`), byte 1 its top 2 bits (bits `2·(g / 4)` of byte
    /// `8 + g mod 4`); bytes 2 and 3 are zeroed by the mask `0x3333…`.
    const Q3K_SCALE_BYTES: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut u = 0;
        while u < 16 {
            let g = k23_group(u);
            t[4 * u] = (2 + g % 8) as u8;
            t[4 * u + 1] = (2 + 8 + g % 4) as u8;
            u += 1;
        }
        t
    };

    /// q3_k: per dword `u`, the right shifts that bring group `g(u)`'s low 4 bits to bits 0..4 and its top 2
    /// bits to bits 4..6 (see `Q3K_SCALE_BYTES`).
    const Q3K_SCALE_SHIFTS: [[u32; 16]; 2] = {
        let mut t = [[0u32; 16]; 2];
        let mut u = 0;
        while u < 16 {
            let g = k23_group(u) as u32;
            t[0][u] = 4 * (g / 8);
            t[1][u] = 8 + 2 * (g / 4) - 4;
            u += 1;
        }
        t
    };

    /// q2_k: `sc · q` for the `vpermb` index `sc | q << 4` (4-bit scale, 2-bit quant): ≤ 45, an unsigned byte
    /// for `vpdpbusd`.
    const Q2K_PRODUCTS: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            t[i] = ((i & 15) * ((i >> 4) & 3)) as u8;
            i += 1;
        }
        t
    };

    /// q3_k: `q + 4` (0..8: the two low bits at `shift`, plus 4 where the mask bit at `hbit` is set) for a
    /// 6-bit `vpermb` index.
    const fn q3_k_quants(shift: u32, hbit: u32) -> [u8; 64] {
        let mut t = [0u8; 64];
        let mut i = 0u32;
        while i < 64 {
            t[i as usize] = (((i >> shift) & 3) + 4 * ((i >> hbit) & 1)) as u8;
            i += 1;
        }
        t
    }
    /// q3_k's quarters 0 and 2 (low bits at 0, mask bit at 4) and 1 and 3 (low bits at 2, mask bit at 5).
    const Q3K_QUANTS: [[u8; 64]; 2] = [q3_k_quants(0, 4), q3_k_quants(2, 5)];

    /// `vpermt2b` indices that gather quarter `j`'s packed vector from the super-block's `i8` activations in
    /// element order (four vectors: `j / 2` as the first source, `2 + j / 2` as the second), for even and odd
    /// `j`: byte `pos` takes element `k23_element(j, pos)`.
    const K23_X_ORDER: [[u8; 64]; 2] = {
        let mut t = [[0u8; 64]; 2];
        let mut odd = 0;
        while odd < 2 {
            let mut pos = 0;
            while pos < 64 {
                let e = k23_element(odd, pos);
                // Element 128n + 32·odd + s: byte 32·odd + s of the first source (n = 0) or the second.
                t[odd][pos] = (64 * (e / 128) + e % 128) as u8;
                pos += 1;
            }
            odd += 1;
        }
        t
    };

    /// Packs `m` tokens of `k` activations (`x`, stride `k`) for [`dot_q2_k_vnni`] (`q3` false) or
    /// [`dot_q3_k_vnni`], [`K23_VNNI_SLOTS`] slots a super-block, `k / 256 ×` that a token. Per super-block: the
    /// 256 activations rounded to `i8` as `quant::round_activations` rounds them (`x ≈ dx · x8`, the same bits:
    /// the same f32 operations), quarter `j`'s at the places `k23_element` gives; per dword `u`, the sum `Σx8`
    /// of group `g(u)` (q3_k: `−4 · Σx8`, the offset of its quants) in the low 16 bits, zeros above; `dx`.
    ///
    /// # Safety
    /// AVX-512F/BW and AVX512_VBMI are present.
    #[must_use]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub unsafe fn pack_k23_vnni(x: &[f32], m: usize, k: usize, q3: bool) -> Vec<f32> {
        // SAFETY: each index is 64 bytes.
        let order = K23_X_ORDER.map(|o| unsafe { _mm512_loadu_si512(o.as_ptr().cast::<__m512i>()) });
        let mut out = vec![0f32; m * k / 256 * K23_VNNI_SLOTS];
        for (xb, ob) in x[..m * k].chunks_exact(256).zip(out.chunks_exact_mut(K23_VNNI_SLOTS)) {
            // SAFETY: xb has 256 f32, 16 vectors.
            let v: [__m512; 16] =
                std::array::from_fn(|i| unsafe { _mm512_loadu_ps(xb.as_ptr().add(16 * i)) });
            let amax = _mm512_reduce_max_ps(
                v.iter().fold(_mm512_setzero_ps(), |a, &x| _mm512_max_ps(a, _mm512_abs_ps(x))),
            );
            // 0 for an all-zero super-block, and for one so small (< 4e-37) that 127 / max |x| overflows, where
            // every x8 is then 0 rather than the conversion's −128 of an infinite x · inv.
            let inv = 127.0 / amax;
            let inv = _mm512_set1_ps(if inv.is_finite() { inv } else { 0.0 });
            // |x · inv| ≤ 127 up to one rounding, so the conversion (to nearest even, the default rounding)
            // stays within ±127 and the saturating narrowing changes nothing.
            let mut q8 = [0i8; 256];
            for (i, &vi) in v.iter().enumerate() {
                // SAFETY: 16 bytes at 16i of q8.
                unsafe {
                    _mm_storeu_si128(
                        q8.as_mut_ptr().add(16 * i).cast::<__m128i>(),
                        _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(vi, inv))),
                    );
                }
            }
            // SAFETY: q8 has 4 vectors of 64 bytes; ob has 64 slots (256 bytes) for the 4 packed ones.
            unsafe {
                let z: [__m512i; 4] =
                    std::array::from_fn(|i| _mm512_loadu_si512(q8.as_ptr().add(64 * i).cast()));
                for j in 0..4 {
                    let v = _mm512_permutex2var_epi8(z[j / 2], order[j % 2], z[2 + j / 2]);
                    _mm512_storeu_si512(ob.as_mut_ptr().add(16 * j).cast::<__m512i>(), v);
                }
            }
            for (u, slot) in ob[64..80].iter_mut().enumerate() {
                let g = k23_group(u);
                let s: i16 = q8[16 * g..16 * g + 16].iter().map(|&v| i16::from(v)).sum();
                let s = if q3 { -4 * s } else { s };
                *slot = f32::from_bits(u32::from(u16::from_le_bytes(s.to_le_bytes())));
            }
            ob[80] = amax / 127.0;
        }
        out
    }

    /// Quarter `j`'s packed activations of super-block `b`, token `t` (64 `i8`).
    ///
    /// # Safety
    /// The packed super-block exists.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn x8(x: *const f32, ldx: usize, t: usize, b: usize, j: usize) -> __m512i {
        // SAFETY: as documented; 16 slots are 64 bytes.
        unsafe { _mm512_loadu_si512(x.add(t * ldx + b * K23_VNNI_SLOTS + 16 * j).cast::<__m512i>()) }
    }

    /// q2_k with AVX512_VBMI and AVX512_VNNI on activations packed by [`pack_k23_vnni`]; see
    /// `qdot::dot_block` and the module documentation.
    ///
    /// Per row and super-block one `vpermb` reorders the 64 quant bytes (`K23_QUANT_ORDER`) and one spreads the
    /// 16 scale bytes to match (`Q2K_SCALE_ORDER`, stored, then a 128-bit broadcast a quarter). Per quarter a
    /// bit-select puts the 2-bit field above its group's 4-bit scale and a `vpermb` lookup turns the pair into
    /// the byte `sc · q`, so `vpdpbusd` against the `i8` activations sums `sc · q · x8` of all four quarters into
    /// one `i32` accumulator: no per-group scaling. The mins' `Σ m · Σx8` is one `vpmaddwd` against the packed
    /// group sums; both become f32 once per row and super-block: `dx · (d · Σ sc·q·x8 − dmin · Σ m·Σx8)`.
    ///
    /// # Safety
    /// As [`dot_q4_k_avx512bf16`], with AVX512_VBMI and AVX512_VNNI present and `x`, `ldx` as [`pack_k23_vnni`]
    /// made them (`ldx` in f32 slots).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_q2_k_vnni<const R: usize, const T: usize>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        // SAFETY: each index and table is 64 bytes.
        let load = |p: *const u8| unsafe { _mm512_loadu_si512(p.cast::<__m512i>()) };
        let (order, spread, products) =
            (load(K23_QUANT_ORDER.as_ptr()), load(Q2K_SCALE_ORDER.as_ptr()), load(Q2K_PRODUCTS.as_ptr()));
        let (field, low4) = (_mm512_set1_epi8(0x30), _mm512_set1_epi32(0x0f));
        let f16s = f16_to_f32_table().as_ptr();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for b in 0..k / 256 {
            // Per row: the spread scale bytes, stored for all rows first, so that no load waits for its store.
            let mut sc = [[0u8; 64]; R];
            for (r, s) in sc.iter_mut().enumerate() {
                // SAFETY: super-block b of row r exists; s has 64 bytes.
                unsafe {
                    let p = w.add(r * ws + b * Q2K_BYTES);
                    prefetch_block(p, Q2K_BYTES, pf);
                    let v =
                        _mm512_permutexvar_epi8(spread, _mm512_castsi128_si512(_mm_loadu_si128(p.cast())));
                    _mm512_storeu_si512(s.as_mut_ptr().cast::<__m512i>(), v);
                }
            }
            // Opaque, so that the quarters' scales stay broadcasts from memory (see `dot_q3_k_vnni`).
            let sc = std::hint::black_box(&sc);
            for (r, (row, s)) in acc.iter_mut().zip(sc).enumerate() {
                // SAFETY: super-block b of row r exists (quants at 16, f16 d and dmin at 80 and 82); the f16
                // table has an entry for every 16-bit pattern; s has 64 bytes; every token's packed super-block
                // b exists.
                unsafe {
                    let p = w.add(r * ws + b * Q2K_BYTES);
                    let q = _mm512_permutexvar_epi8(order, load(p.add(16)));
                    let mut dots = [_mm512_setzero_si512(); T];
                    for j in 0..4 {
                        // Field j to bits 4..6; 16-bit shifts move no bits of the other byte there.
                        let fj = match j {
                            0 => _mm512_slli_epi16::<4>(q),
                            1 => _mm512_slli_epi16::<2>(q),
                            2 => q,
                            _ => _mm512_srli_epi16::<2>(q),
                        };
                        let scales = _mm512_broadcast_i32x4(_mm_loadu_si128(s.as_ptr().add(16 * j).cast()));
                        let sq = _mm512_permutexvar_epi8(
                            _mm512_ternarylogic_epi32::<0xca>(field, fj, scales),
                            products,
                        );
                        for (t, dt) in dots.iter_mut().enumerate() {
                            *dt = _mm512_dpbusd_epi32(*dt, sq, x8(x, ldx, t, b, j));
                        }
                    }
                    let f16_at = |at: usize| {
                        _mm512_set1_ps(*f16s.add(usize::from(p.add(at).cast::<u16>().read_unaligned())))
                    };
                    let (d, dmin) = (f16_at(80), f16_at(82));
                    let mins = _mm512_and_si512(_mm512_srli_epi32::<4>(load(s.as_ptr())), low4);
                    for (t, (a, dt)) in row.iter_mut().zip(dots).enumerate() {
                        let xt = x.add(t * ldx + b * K23_VNNI_SLOTS);
                        let m = _mm512_cvtepi32_ps(_mm512_madd_epi16(mins, load(xt.add(64).cast())));
                        let v = _mm512_fmsub_ps(_mm512_cvtepi32_ps(dt), d, _mm512_mul_ps(m, dmin));
                        *a = _mm512_fmadd_ps(v, _mm512_set1_ps(*xt.add(80)), *a);
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

    /// q3_k with AVX512_VBMI and AVX512_VNNI on activations packed by [`pack_k23_vnni`]; see
    /// `qdot::dot_block` and the module documentation.
    ///
    /// Per row and super-block, `vpermb` reorders the 64 low-bit bytes and the 32 mask bytes alike
    /// (`K23_QUANT_ORDER`). One index byte serves two quarters: bits 0..4 the
    /// two quarters' low-bit fields, bits 4..6 their mask bits, brought there by a rotate per dword (the dwords
    /// of the two halves need different ones); a `vpermb` lookup per quarter gives `q + 4` (0..8). `vpdpbusd`
    /// sums 4 products of one group per dword, and `vpdpwssd` scales the dwords by their groups' `sc − 32`
    /// (a 128-bit broadcast a quarter) into one `i32` accumulator, to which one more `vpdpwssd` adds the offset
    /// `−4 · (sc − 32) · Σx8` from the packed sums; the sum becomes f32 once per row and super-block, times
    /// `d · dx`.
    ///
    /// # Safety
    /// As [`dot_q2_k_vnni`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn dot_q3_k_vnni<const R: usize, const T: usize>(
        pf: Prefetch,
        x: *const f32,
        ldx: usize,
        w: *const u8,
        ws: usize,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        // SAFETY: each index and table is 64 bytes.
        let load = |p: *const u8| unsafe { _mm512_loadu_si512(p.cast::<__m512i>()) };
        let (order, gather) = (load(K23_QUANT_ORDER.as_ptr()), load(Q3K_SCALE_BYTES.as_ptr()));
        let shifts = Q3K_SCALE_SHIFTS.map(|t| load(t.as_ptr().cast()));
        let tables = Q3K_QUANTS.map(|t| load(t.as_ptr()));
        // Per dword u = 4r + L (half n = L / 2): rotations that bring mask bits 4n, 4n + 1 (quarters 0, 1) and
        // 4n + 2, 4n + 3 (quarters 2, 3) of each byte to bits 4, 5.
        let rot01 = _mm512_broadcast_i32x4(_mm_setr_epi32(4, 4, 0, 0));
        let rot23 = _mm512_broadcast_i32x4(_mm_setr_epi32(2, 2, 30, 30));
        let low4 = _mm512_set1_epi8(0x0f);
        let f16s = f16_to_f32_table().as_ptr();
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for b in 0..k / 256 {
            // Per row: `sc − 32` of group g(u) in the low 16 bits of dword u (zeros above, for `vpdpwssd`).
            let mut sc = [[0i32; 16]; R];
            // Per row and token: the offset `−4 · (sc − 32) · Σx8`, where the main sums start.
            let mut offsets = [[_mm512_setzero_si512(); T]; R];
            for (r, (s, off)) in sc.iter_mut().zip(&mut offsets).enumerate() {
                // SAFETY: super-block b of row r exists; s has 64 bytes.
                unsafe {
                    let p = w.add(r * ws + b * Q3K_BYTES);
                    prefetch_block(p, Q3K_BYTES, pf);
                    let v = _mm512_maskz_permutexvar_epi8(
                        0x3333_3333_3333_3333,
                        gather,
                        _mm512_castsi128_si512(_mm_loadu_si128(p.add(94).cast())),
                    );
                    // Low bits | top bits, in 16-bit lanes minus 32: the high halves stay 0.
                    let v = _mm512_ternarylogic_epi32::<0xca>(
                        _mm512_set1_epi32(0x0f),
                        _mm512_srlv_epi32(v, shifts[0]),
                        _mm512_and_si512(_mm512_srlv_epi32(v, shifts[1]), _mm512_set1_epi32(0x30)),
                    );
                    let v = _mm512_sub_epi16(v, _mm512_set1_epi32(32));
                    _mm512_storeu_si512(s.as_mut_ptr().cast::<__m512i>(), v);
                    for (t, o) in off.iter_mut().enumerate() {
                        let sums = load(x.add(t * ldx + b * K23_VNNI_SLOTS + 64).cast());
                        *o = _mm512_dpwssds_epi32(_mm512_setzero_si512(), v, sums);
                    }
                }
            }
            // Opaque to the optimiser, so that the scales below stay 128-bit broadcasts from memory (load ports)
            // instead of becoming shuffles of the stored vectors (LLVM's choice otherwise), which would take the
            // shuffle port the lookups need.
            let sc = std::hint::black_box(&sc);
            for (r, ((row, s), off)) in acc.iter_mut().zip(sc).zip(offsets).enumerate() {
                // SAFETY: super-block b of row r exists (mask bytes at 0, low bits at 32, f16 d at 108); the f16
                // table has an entry for every 16-bit pattern; s has 16 dwords; every token's packed
                // super-block b exists.
                unsafe {
                    let p = w.add(r * ws + b * Q3K_BYTES);
                    let q = _mm512_permutexvar_epi8(order, load(p.add(32)));
                    // The mask bytes in both halves: byte l serves elements l + 32i of both.
                    let h = _mm512_permutexvar_epi8(
                        order,
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(p.cast::<__m256i>())),
                    );
                    // Quarters 0, 1 and 2, 3: low-bit fields at bits 0..4, mask bits at 4..6.
                    let idx = [
                        _mm512_ternarylogic_epi32::<0xca>(low4, q, _mm512_rolv_epi32(h, rot01)),
                        _mm512_ternarylogic_epi32::<0xca>(
                            low4,
                            _mm512_srli_epi16::<4>(q),
                            _mm512_rolv_epi32(h, rot23),
                        ),
                    ];
                    let mut sums = off;
                    for j in 0..4 {
                        let qv = _mm512_permutexvar_epi8(idx[j / 2], tables[j % 2]);
                        let scales = _mm512_broadcast_i32x4(_mm_loadu_si128(s.as_ptr().add(4 * j).cast()));
                        for (t, st) in sums.iter_mut().enumerate() {
                            let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qv, x8(x, ldx, t, b, j));
                            *st = _mm512_dpwssds_epi32(*st, scales, dot);
                        }
                    }
                    let d = _mm512_set1_ps(*f16s.add(usize::from(p.add(108).cast::<u16>().read_unaligned())));
                    for (t, (a, st)) in row.iter_mut().zip(sums).enumerate() {
                        let v = _mm512_mul_ps(_mm512_cvtepi32_ps(st), d);
                        *a =
                            _mm512_fmadd_ps(v, _mm512_set1_ps(*x.add(t * ldx + b * K23_VNNI_SLOTS + 80)), *a);
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

    /// q6_k with AVX512_BF16 on activations packed by [`pack_k_bf16`]; see `qdot::dot_block` and the module
    /// documentation.
    ///
    /// Per half of 128 and row: one 64-byte load of the low-nibble bytes, read as 16-bit lanes (4 nibbles a
    /// lane, no widening), and one 32-byte load of the high-pair bytes broadcast to both halves (whose upper
    /// lanes one masked shift moves to the pairs of quarters 1 and 3). Bit-selects (and for the odd elements a
    /// shift) put a nibble and its pair at the low 6 bits of each lane; `vpermt2w` turns them into bf16 `q − 32`
    /// (the elements in the packed activations' order: even, then odd ones of two quarters), and two
    /// `vdpbf16ps` chained sum each f32 lane over 4 elements of one group, so that one FMA by a vector of the 4
    /// groups' `d·scale` (a `vpermps` of the row's 16) serves two quarters.
    ///
    /// Per row and super-block: 45 vector µops (3 for the scales; per half 3 shifts, 4 bit-selects, 2 shifts,
    /// 4 lookups, 2 `vpermps`, 4 `vdpbf16ps`, 2 FMAs), 13 of them on the shuffle port, against about 67 with 23
    /// for the kernel it replaced (a `vpmovzxbw` per 32 bytes, a `vpermps` and an FMA per quarter, and the bf16
    /// conversion of the activations for every register block of rows); on this repository's 2-core Zen 5,
    /// 1.21× per core (results/exec/quant, session 17).
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
        let low4 = _mm512_set1_epi16(0x0f);
        let nib2 = _mm512_set1_epi16(0x0f00);
        // Per pair (p = 0: quarters 0, 1; p = 1: quarters 2, 3) of half h, lane i sums 4 elements of group
        // 8h + 4p + i / 4: the indices of its scales, without the 8h.
        let groups = [0, 4].map(|p| {
            _mm512_setr_epi32(
                p,
                p,
                p,
                p,
                p + 1,
                p + 1,
                p + 1,
                p + 1,
                p + 2,
                p + 2,
                p + 2,
                p + 2,
                p + 3,
                p + 3,
                p + 3,
                p + 3,
            )
        });
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
                for (r, row) in acc.iter_mut().enumerate() {
                    // SAFETY: the half's 64 low-nibble bytes, and its 32 high-pair bytes in both halves.
                    let (v, qh) = unsafe {
                        let p = w.add(r * ws + b * Q6K_BYTES);
                        (
                            _mm512_loadu_si512(p.add(64 * h).cast()),
                            _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * h).cast::<__m256i>())),
                        )
                    };
                    // 16-bit lane l holds low-nibble bytes 2l, 2l + 1 (quarter 0 below lane 16, quarter 1 from
                    // it; their high nibbles quarters 2 and 3) and high-pair bytes 2l, 2l + 1 (mod 32), whose
                    // pairs for quarters 1 and 3 move down to those of 0 and 2 in the upper lanes.
                    let qh = _mm512_mask_srli_epi16(qh, 0xffff_0000, qh, 2);
                    let (qh4, v4) = (_mm512_slli_epi16::<4>(qh), _mm512_srli_epi16::<4>(v));
                    // 6-bit indices (`vpermt2w` reads the low 6 bits; those above are left as they come): the
                    // nibble at bits 0..4 and its pair at 4..6, for the even elements of quarters 0, 1 (of
                    // byte 2l), the odd ones (byte 2l + 1), then the same of quarters 2, 3.
                    let sel = |m: __m512i, a: __m512i, b: __m512i| _mm512_ternarylogic_epi32::<0xca>(m, a, b);
                    let idx = [
                        sel(low4, v, qh4),
                        _mm512_srli_epi16::<8>(sel(nib2, v, qh4)),
                        sel(low4, v4, qh),
                        _mm512_srli_epi16::<8>(sel(nib2, v4, qh)),
                    ];
                    let wv = idx.map(|ix| {
                        // SAFETY: __m512i and __m512bh are both 512 bits of plain data.
                        unsafe {
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_permutex2var_epi16(tlo, ix, thi))
                        }
                    });
                    let gh = _mm512_set1_epi32(8 * h as i32);
                    let scale = groups.map(|g| _mm512_permutexvar_ps(_mm512_add_epi32(g, gh), ds[r]));
                    for (t, a) in row.iter_mut().enumerate() {
                        // SAFETY: token t's packed super-block b exists; __m512i and __m512bh are both 512 bits
                        // of plain data.
                        let xv: [__m512bh; 4] = std::array::from_fn(|i| unsafe {
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                                x.add(t * ldx + b * Q6K_BF16_SLOTS + 64 * h + 16 * i).cast(),
                            ))
                        });
                        for p in 0..2 {
                            let dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), xv[2 * p], wv[2 * p]);
                            let dot = _mm512_dpbf16_ps(dot, xv[2 * p + 1], wv[2 * p + 1]);
                            *a = _mm512_fmadd_ps(dot, scale[p], *a);
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
    use crate::quant::{QFormat, q4_k_scale_min, round_activations};

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

    /// The activations a q2_k/q3_k GEMV computes with (`round_activations`' `dx · q`, exact in f64); `x`
    /// itself for the other formats.
    fn gemv_x(fmt: QFormat, x: &[f32]) -> Vec<f64> {
        if !fmt.rounds_activations() {
            return x.iter().map(|&v| f64::from(v)).collect();
        }
        let mut q = [0i8; 256];
        x.chunks_exact(256)
            .flat_map(|xb| {
                let dx = round_activations(xb, &mut q);
                q.map(|v| f64::from(v) * f64::from(dx))
            })
            .collect()
    }

    /// `R` rows × `T` tokens of `fmt` through `dot_block` with `isa`, against dequantise-then-f64 (on the
    /// rounded activations for q2_k and q3_k, on every ISA): the error may be that of f32 operations, relative
    /// to `Σ |x·w|` (the mins may cancel the rest).
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
        let xr = gemv_x(fmt, &x[..T * k]);
        for (r, row) in got.iter().enumerate() {
            for (t, &g) in row.iter().enumerate() {
                let terms = xr[t * k..(t + 1) * k].iter().zip(&deq[r * k..(r + 1) * k]);
                let (want, scale) = terms.fold((0f64, 0f64), |(s, a), (&xi, &wi)| {
                    let p = xi * f64::from(wi);
                    (s + p, a + p.abs())
                });
                assert!(
                    (f64::from(g) - want).abs() <= 1e-5 * scale + 1e-30,
                    "{isa:?} {fmt:?} {R}x{T} row {r} token {t}: {g} vs {want} (Σ|x·w| {scale})"
                );
            }
        }
    }

    /// Every ISA path (AVX512_BF16, AVX-512 and AVX2 where present, plain Rust) on random K-quant
    /// super-blocks: random quants, scales and mask bits, with `d` and `dmin` drawn from edge values (zero,
    /// subnormal, ±65504, negative), some blocks with all scale bytes zero (q3_k: every scale −32), and some with
    /// every min at its largest (q2_k 15; q4_k every scale and min 63); activations centred on zero, and all
    /// positive (where offset quants, such as the AVX512_BF16 q4_k kernel's `16 + q`, cancel least exactly).
    #[test]
    fn k_quant_dot_products_agree_on_every_isa_with_edge_blocks() {
        let edges = [0.0f32, 6.0e-8, 1.0, -0.37, 65504.0, -65504.0, 3.1e-3];
        let k = 1024;
        let centred: Vec<f32> = random_bytes(4 * k * 2, 7)
            .chunks_exact(2)
            .map(|b| half::bf16::from_f32(f32::from(i16::from_le_bytes([b[0], b[1]])) / 16384.0).to_f32())
            .collect();
        let positive: Vec<f32> =
            centred.iter().map(|v| half::bf16::from_f32(v.abs() + 0.5).to_f32()).collect();
        let isas = detect().and_weaker();
        assert!(isas.contains(&Isa::Portable));
        // Format, super-block bytes, offsets of `d` and `dmin` (none: no mins).
        let formats = [
            (QFormat::Q2K, 84, 80, Some(82)),
            (QFormat::Q3K, 110, 108, None),
            (QFormat::Q4K, 144, 0, Some(2)),
            (QFormat::Q6K, 210, 208, None),
        ];
        for (fmt, bb, d_at, dmin_at) in formats {
            let mut w = random_bytes(8 * k / 256 * bb, bb as u64);
            for (i, blk) in w.chunks_exact_mut(bb).enumerate() {
                let d = half::f16::from_f32(edges[i % edges.len()]).to_le_bytes();
                blk[d_at..d_at + 2].copy_from_slice(&d);
                if let Some(at) = dmin_at {
                    let dmin = half::f16::from_f32(edges[(i * 3 + 1) % edges.len()]).to_le_bytes();
                    blk[at..at + 2].copy_from_slice(&dmin);
                }
                match (fmt, i % 5) {
                    (QFormat::Q2K, 1) => blk[..16].fill(0),
                    (QFormat::Q2K, 2) => blk[..16].iter_mut().for_each(|s| *s |= 0xf0),
                    (QFormat::Q3K, 1) => blk[96..108].fill(0),
                    (QFormat::Q4K, 1) => blk[4..16].fill(0),
                    (QFormat::Q4K, 2) => blk[4..16].fill(0xff),
                    (QFormat::Q6K, 1) => blk[192..208].fill(0),
                    _ => {}
                }
            }
            for &isa in &isas {
                for x in [&centred, &positive] {
                    check_dot::<8, 1>(isa, fmt, &w, x, k);
                    check_dot::<4, 4>(isa, fmt, &w, x, k);
                    check_dot::<1, 4>(isa, fmt, &w[2 * fmt.row_bytes(k)..], x, k);
                    check_dot::<1, 1>(isa, fmt, &w[5 * fmt.row_bytes(k)..], x, k);
                }
            }
        }
    }

    /// Hand-made q2_k and q3_k super-blocks through every ISA path: extreme quants, scales, mins and mask
    /// bits, against activations with one outlier per super-block (the 8-bit step is then coarse for the rest),
    /// all equal, alternating in sign, or zero.
    #[test]
    fn k23_dot_products_match_the_reference_on_hand_made_blocks() {
        let k = 512;
        let outlier: Vec<f32> =
            (0..k).map(|i| if i % 256 == 37 { 300.0 } else { (i % 7) as f32 * 0.25 - 0.75 }).collect();
        let equal = vec![1.5f32; k];
        let signs: Vec<f32> = (0..k).map(|i| if i % 2 == 0 { 2.0 } else { -2.0 }).collect();
        let zeros = vec![0f32; k];
        let one = half::f16::from_f32(1.0).to_le_bytes();
        let mut q2 = Vec::new();
        // q2_k: every quant 3, scale 15, min 15; every quant 0 with mins only; alternating fields and scales.
        for (quants, scales, dmin) in
            [(0xffu8, 0xffu8, 1.0f32), (0x00, 0xf0, 0.5), (0x1b, 0x5a, -2.0), (0xe4, 0x0f, 0.0)]
        {
            q2.extend([scales; 16]);
            q2.extend([quants; 64]);
            q2.extend(one);
            q2.extend(half::f16::from_f32(dmin).to_le_bytes());
        }
        let mut q3 = Vec::new();
        // q3_k: mask all set / clear / alternating bits, low bits 3 / 0 / mixed, scales 63 (31 after the offset),
        // 0 (−32) and a mix.
        for (mask, low, packed) in
            [(0xffu8, 0xffu8, 0xffu8), (0x00, 0x00, 0x00), (0xa5, 0x1b, 0x3c), (0x5a, 0xe4, 0xc3)]
        {
            q3.extend([mask; 32]);
            q3.extend([low; 64]);
            q3.extend([packed; 12]);
            q3.extend(half::f16::from_f32(-0.75).to_le_bytes());
        }
        for isa in detect().and_weaker() {
            for (fmt, w) in [(QFormat::Q2K, &q2), (QFormat::Q3K, &q3)] {
                for x in [&outlier, &equal, &signs, &zeros] {
                    let x4: Vec<f32> = x.iter().copied().cycle().take(4 * k).collect();
                    check_dot::<2, 1>(isa, fmt, w, x, k);
                    check_dot::<2, 4>(isa, fmt, w, &x4, k);
                }
            }
        }
    }

    /// The packed activations of q2_k/q3_k (`pack_x`) on every ISA hold `round_activations`' values bit for
    /// bit. VNNI kernels (`pack_k23_vnni`): per super-block every element's `i8` once, at the place the
    /// documented layout gives it; the group sums (q3_k: times −4) in the low 16 bits of their dwords; `dx`.
    /// Other ISAs: the f32 rows `dx · q`. Random rows, then hand-made super-blocks: a zero one, a tiny one, ties
    /// at .5 with the largest magnitude positive and negative.
    #[test]
    #[allow(clippy::float_cmp)] // the same f32 operations give the same bits
    fn k23_packed_activations_are_the_rounded_ones_in_lane_order_with_the_group_sums() {
        let (m, k) = (3, 1024);
        let mut x: Vec<f32> = random_bytes(m * k * 4, 11)
            .chunks_exact(4)
            .map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])) / f32::from(1 + u16::from(b[2] >> 3)))
            .collect();
        x[256..512].fill(0.0);
        x[512..768].iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 128.0) * 1e-39);
        // Largest magnitude 127 (negative): `127 / a` is 1, so the halves (i − 127) / 2 are ties, exactly.
        x[768..1024].iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 127.0) * 0.5);
        x[768 + 255] = -127.0;
        for fmt in [QFormat::Q2K, QFormat::Q3K] {
            for isa in detect().and_weaker() {
                let (p, ld) = pack_x(isa, fmt, &x, m, k).expect("q2_k and q3_k activations are rounded");
                let vnni = isa == Isa::Avx512Bf16;
                assert_eq!((ld, p.len()), (if vnni { k / 256 * 84 } else { k }, m * ld), "{isa:?}");
                let bytes: Vec<u8> = p.iter().flat_map(|v| v.to_le_bytes()).collect();
                for t in 0..m {
                    for b in 0..k / 256 {
                        let mut want = [0i8; 256];
                        let dx = round_activations(&x[t * k + 256 * b..][..256], &mut want);
                        if !vnni {
                            for (i, (&got, &q)) in p[t * ld + 256 * b..][..256].iter().zip(&want).enumerate()
                            {
                                assert_eq!(got, f32::from(q) * dx, "{isa:?} {fmt:?} token {t} element {i}");
                            }
                            continue;
                        }
                        let slots = &bytes[4 * (t * ld + b * 84)..][..4 * 84];
                        assert_eq!(
                            f32::from_le_bytes(slots[320..324].try_into().unwrap()).to_bits(),
                            dx.to_bits()
                        );
                        let mut seen = [false; 256];
                        for (i, &byte) in slots[..256].iter().enumerate() {
                            let (j, pos) = (i / 64, i % 64);
                            let (r, l, e) = (pos / 16, (pos / 4) % 4, pos % 4);
                            let at = 128 * (l / 2) + 32 * j + 16 * (l % 2) + 4 * r + e;
                            assert!(!seen[at], "element {at} twice");
                            seen[at] = true;
                            assert_eq!(i8::from_le_bytes([byte]), want[at], "{fmt:?} token {t} element {at}");
                        }
                        for (u, sum) in slots[256..320].chunks_exact(4).enumerate() {
                            let g = 2 * (u / 4) + [0, 1, 8, 9][u % 4];
                            let want = want[16 * g..16 * g + 16].iter().map(|&v| i32::from(v)).sum::<i32>()
                                * if fmt == QFormat::Q3K { -4 } else { 1 };
                            let low = i32::from(i16::from_le_bytes([sum[0], sum[1]]));
                            assert_eq!((low, sum[2], sum[3]), (want, 0, 0), "group {g}");
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
