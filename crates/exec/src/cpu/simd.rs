//! SIMD inner loops of the CPU matmul and attention: f32 activations against f16/bf16 rows with f32
//! accumulation. AVX-512 and AVX2+FMA+F16C paths are chosen at run time with `is_x86_feature_detected!`;
//! the portable path computes the same sums in a different order.
//!
//! bf16 widens to f32 by a 16-bit shift; f16 widens with the hardware conversion. Products of f16/bf16
//! values are exact in f32, so the paths differ only in the order of the f32 additions.

use crate::host::Elem;

/// The instruction set the kernels use on this machine, weakest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust.
    Portable,
    /// AVX2 + FMA + F16C (8 lanes).
    Avx2,
    /// AVX-512F (16 lanes).
    Avx512,
    /// AVX-512F with BW, BF16, VBMI and VNNI: as `Avx512`, and quantised blocks go through bf16 dot products,
    /// q2_k/q3_k through VBMI byte lookups and VNNI integer dot products (every CPU with AVX512_BF16 but Cooper
    /// Lake has both).
    Avx512Bf16,
}

impl Isa {
    /// This instruction set and every weaker one, strongest first (what a machine that has it can run).
    #[must_use]
    pub fn and_weaker(self) -> Vec<Isa> {
        [Isa::Avx512Bf16, Isa::Avx512, Isa::Avx2, Isa::Portable].into_iter().filter(|&i| i <= self).collect()
    }
}

/// The best instruction set available.
#[must_use]
pub fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::env::var_os("PIPESHARD_CPU_PORTABLE").is_some() {
            return Isa::Portable;
        }
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("f16c") {
            // PIPESHARD_CPU_NO_BF16 keeps the f32 block kernels (to compare, or should the bf16 path misbehave).
            if is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512bf16")
                && is_x86_feature_detected!("avx512vbmi")
                && is_x86_feature_detected!("avx512vnni")
                && std::env::var_os("PIPESHARD_CPU_NO_BF16").is_none()
            {
                return Isa::Avx512Bf16;
            }
            return Isa::Avx512;
        }
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Isa::Avx2;
        }
    }
    Isa::Portable
}

#[inline]
fn widen(e: Elem, w: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([w[2 * i], w[2 * i + 1]]);
    match e {
        Elem::Bf16 => f32::from_bits(u32::from(bits) << 16),
        Elem::F16 => half::f16::from_bits(bits).to_f32(),
        Elem::F32 => unreachable!("matrices are f16 or bf16"),
    }
}

/// `out[r][t] = Σ_i x[t][i] · w[r][i]` for `R` weight rows (`w` rows of `k` elements, stride `k`) and `T`
/// activation rows (stride `ldx`).
///
/// # Safety
/// `w` holds at least `R × k` 2-byte elements and `x` at least `(T − 1) × ldx + k` f32s; the ISA was detected.
#[inline]
pub unsafe fn dot_block<const R: usize, const T: usize>(
    isa: Isa,
    elem: Elem,
    x: *const f32,
    ldx: usize,
    w: *const u16,
    k: usize,
    out: &mut [[f32; T]; R],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from the caller; Avx512 is only returned by `detect` when present.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
            if elem == Elem::Bf16 {
                x86::dot_block_avx512::<R, T, true>(x, ldx, w, k, out);
            } else {
                x86::dot_block_avx512::<R, T, false>(x, ldx, w, k, out);
            }
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above for AVX2.
        Isa::Avx2 => unsafe {
            if elem == Elem::Bf16 {
                x86::dot_block_avx2::<R, T, true>(x, ldx, w, k, out);
            } else {
                x86::dot_block_avx2::<R, T, false>(x, ldx, w, k, out);
            }
        },
        _ => {
            // SAFETY: sizes as documented.
            let wb = unsafe { std::slice::from_raw_parts(w.cast::<u8>(), R * k * 2) };
            for (r, row) in out.iter_mut().enumerate() {
                for (t, o) in row.iter_mut().enumerate() {
                    // SAFETY: sizes as documented.
                    let xs = unsafe { std::slice::from_raw_parts(x.add(t * ldx), k) };
                    *o = xs.iter().enumerate().map(|(i, &xv)| xv * widen(elem, wb, r * k + i)).sum();
                }
            }
        }
    }
}

/// `Σ_i q[i] · kv[i]` with `kv` a row of `q.len()` elements stored as `elem`.
#[must_use]
pub fn dot_kv(isa: Isa, q: &[f32], kv: &[u8], elem: Elem) -> f32 {
    debug_assert!(kv.len() >= q.len() * elem.size_bytes());
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: AVX2/F16C were detected (Avx512 implies them on every CPU that has it, and detect checks f16c);
        // lengths checked above.
        return unsafe { x86::dot_kv_avx2(q, kv, elem) };
    }
    let _ = isa;
    q.iter().enumerate().map(|(i, &a)| a * elem.read(kv, i)).sum()
}

/// `acc[i] += p · kv[i]` with `kv` a row of `acc.len()` elements stored as `elem`.
pub fn axpy_kv(isa: Isa, acc: &mut [f32], p: f32, kv: &[u8], elem: Elem) {
    debug_assert!(kv.len() >= acc.len() * elem.size_bytes());
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: as in dot_kv.
        unsafe { x86::axpy_kv_avx2(acc, p, kv, elem) };
        return;
    }
    let _ = isa;
    for (i, a) in acc.iter_mut().enumerate() {
        *a += p * elem.read(kv, i);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m256, __m512, _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
        _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_set1_ps, _mm256_setzero_ps,
        _mm256_slli_epi32, _mm256_storeu_ps, _mm512_castsi512_ps, _mm512_cvtepu16_epi32, _mm512_cvtph_ps,
        _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_reduce_add_ps, _mm512_setzero_ps, _mm512_slli_epi32,
    };

    use crate::host::Elem;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(w: *const u16, bf16: bool) -> __m256 {
        // SAFETY: the caller guarantees 8 readable u16 at w.
        let h = unsafe { _mm_loadu_si128(w.cast()) };
        if bf16 {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        } else {
            _mm256_cvtph_ps(h)
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

    #[inline]
    fn widen_scalar(bits: u16, bf16: bool) -> f32 {
        if bf16 { f32::from_bits(u32::from(bits) << 16) } else { half::f16::from_bits(bits).to_f32() }
    }

    /// AVX2 block kernel; see `dot_block`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_block_avx2<const R: usize, const T: usize, const BF16: bool>(
        x: *const f32,
        ldx: usize,
        w: *const u16,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut i = 0;
        while i + 8 <= k {
            let mut xv = [_mm256_setzero_ps(); T];
            for (t, v) in xv.iter_mut().enumerate() {
                // SAFETY: i + 8 <= k and x rows hold k f32.
                *v = unsafe { _mm256_loadu_ps(x.add(t * ldx + i)) };
            }
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: w rows hold k u16.
                let wv = unsafe { load8(w.add(r * k + i), BF16) };
                for (t, a) in row.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(xv[t], wv, *a);
                }
            }
            i += 8;
        }
        for r in 0..R {
            for t in 0..T {
                let mut s = hsum8(acc[r][t]);
                for j in i..k {
                    // SAFETY: j < k.
                    s += unsafe { *x.add(t * ldx + j) * widen_scalar(*w.add(r * k + j), BF16) };
                }
                out[r][t] = s;
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn load16(w: *const u16, bf16: bool) -> __m512 {
        // SAFETY: the caller guarantees 16 readable u16 at w.
        let h = unsafe { _mm256_loadu_si256(w.cast()) };
        if bf16 {
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
        } else {
            _mm512_cvtph_ps(h)
        }
    }

    /// AVX-512 block kernel; see `dot_block`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn dot_block_avx512<const R: usize, const T: usize, const BF16: bool>(
        x: *const f32,
        ldx: usize,
        w: *const u16,
        k: usize,
        out: &mut [[f32; T]; R],
    ) {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut i = 0;
        while i + 16 <= k {
            let mut xv = [_mm512_setzero_ps(); T];
            for (t, v) in xv.iter_mut().enumerate() {
                // SAFETY: i + 16 <= k.
                *v = unsafe { _mm512_loadu_ps(x.add(t * ldx + i)) };
            }
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: w rows hold k u16.
                let wv = unsafe { load16(w.add(r * k + i), BF16) };
                for (t, a) in row.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(xv[t], wv, *a);
                }
            }
            i += 16;
        }
        for r in 0..R {
            for t in 0..T {
                let mut s = _mm512_reduce_add_ps(acc[r][t]);
                for j in i..k {
                    // SAFETY: j < k.
                    s += unsafe { *x.add(t * ldx + j) * widen_scalar(*w.add(r * k + j), BF16) };
                }
                out[r][t] = s;
            }
        }
    }

    /// q · kv-row, AVX2.
    // Unaligned loads (`loadu`) read the byte slice as f32/u16; the scalar tail indexes two slices at once.
    #[allow(clippy::cast_ptr_alignment, clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_kv_avx2(q: &[f32], kv: &[u8], elem: Elem) -> f32 {
        let n = q.len();
        let mut i = 0;
        let mut s = 0f32;
        match elem {
            Elem::F32 => {
                let mut a0 = _mm256_setzero_ps();
                let mut a1 = _mm256_setzero_ps();
                while i + 16 <= n {
                    // SAFETY: kv holds n f32 (checked by the caller), q holds n.
                    unsafe {
                        let k0 = _mm256_loadu_ps(kv.as_ptr().cast::<f32>().add(i));
                        let k1 = _mm256_loadu_ps(kv.as_ptr().cast::<f32>().add(i + 8));
                        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i)), k0, a0);
                        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i + 8)), k1, a1);
                    }
                    i += 16;
                }
                s += hsum8(a0) + hsum8(a1);
            }
            Elem::F16 | Elem::Bf16 => {
                let bf = elem == Elem::Bf16;
                let mut a0 = _mm256_setzero_ps();
                let mut a1 = _mm256_setzero_ps();
                while i + 16 <= n {
                    // SAFETY: kv holds n 2-byte elements, q holds n.
                    unsafe {
                        let p = kv.as_ptr().cast::<u16>();
                        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i)), load8(p.add(i), bf), a0);
                        a1 = _mm256_fmadd_ps(
                            _mm256_loadu_ps(q.as_ptr().add(i + 8)),
                            load8(p.add(i + 8), bf),
                            a1,
                        );
                    }
                    i += 16;
                }
                s += hsum8(a0) + hsum8(a1);
            }
        }
        for j in i..n {
            s += q[j] * elem.read(kv, j);
        }
        s
    }

    /// acc += p · kv-row, AVX2.
    #[allow(clippy::cast_ptr_alignment, clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_kv_avx2(acc: &mut [f32], p: f32, kv: &[u8], elem: Elem) {
        let n = acc.len();
        let pv = _mm256_set1_ps(p);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: kv holds n elements of elem (checked by the caller), acc holds n.
            unsafe {
                let v = match elem {
                    Elem::F32 => _mm256_loadu_ps(kv.as_ptr().cast::<f32>().add(i)),
                    Elem::F16 => load8(kv.as_ptr().cast::<u16>().add(i), false),
                    Elem::Bf16 => load8(kv.as_ptr().cast::<u16>().add(i), true),
                };
                let a = _mm256_loadu_ps(acc.as_ptr().add(i));
                _mm256_storeu_ps(acc.as_mut_ptr().add(i), _mm256_fmadd_ps(pv, v, a));
            }
            i += 8;
        }
        for j in i..n {
            acc[j] += p * elem.read(kv, j);
        }
    }
}
