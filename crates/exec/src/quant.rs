//! Block-quantised matrix formats, bit-exact with GGUF: `q8_0` (an f16 scale `d` and 32 signed bytes,
//! value = `q · d`) and `q4_0` (an f16 scale `d` and 16 bytes of nibbles, value = `(q − 8) · d`; the low nibble
//! of byte `j` is element `j`, the high nibble element `j + 16`), and the K-quants `q2_k`, `q3_k`, `q4_k` and
//! `q6_k`, whose super-blocks of 256 elements carry 4-, 6- or 8-bit scales per sub-block of 16 or 32 elements
//! (layouts in the comments of their dequantisers). A row of `k` elements is `k / block_elems` blocks laid out
//! back to back, so a matrix is its rows' blocks in row order, as in a GGUF file.
//!
//! [`QFormat::quantize_row`] follows ggml's reference quantisers (`quantize_row_q8_0_ref`,
//! `quantize_row_q4_0_ref`, `quantize_row_q{2,3,4,6}_K_ref`), operation for operation in f32 without fused
//! multiply-adds, so it writes the bytes ggml writes: for q8_0/q4_0 the scale is computed from the block's
//! largest magnitude and stored rounded to f16, while the quants are computed with the unrounded f32 scale; the
//! K-quants search each sub-block's scale (and q2_k's and q4_k's min) by weighted least squares, quantise the
//! scales against the super-block's f16 scale, and recompute the quants from the stored scales.
//! [`QFormat::dequantize_row`] is ggml's `dequantize_row_*`: for q8_0/q4_0 the product of a small integer and
//! an f16 is exact in f32, so dequantised values are exact; the K-quants form their products in ggml's order.

use half::f16;
use pipeshard_core::dtype::DType;

/// Elements per block of q8_0 and q4_0 (`QK8_0`, `QK4_0`).
pub const BLOCK_ELEMS: usize = 32;

/// The most tokens a quantised matmul takes with exactly dequantised (f32) weights, as a GEMV that
/// dequantises while it reads. With more tokens (prefill), CPU and GPU alike first dequantise the weights to
/// bf16 (the activation type of quantised models) and run a bf16 GEMM, so both sides compute the same function
/// for every token count. q2_k and q3_k GEMVs first round the activations to 8 bits per super-block
/// ([`round_activations`]), on both sides, so that CPUs with AVX512_VNNI can multiply in integers
/// (`cpu::kdot`'s module documentation says why and at what cost).
pub const EXACT_MAX_TOKENS: usize = 8;

/// One super-block ([`K_BLOCK_ELEMS`]) of activations as q2_k and q3_k GEMVs use them, on the CPU (every ISA)
/// and the GPU alike: `x ≈ dx · q`. With `a = max |x|`: `dx = a / 127`, and `q` is `x · (127 / a)` rounded to
/// the nearest integer, ties to even; each of the quotients and the product is one correctly rounded f32
/// operation (no fused multiply-add, no reciprocal approximation), so both sides get the same bits. Where
/// `127 / a` is not finite (an all-zero block, or `a` < 127 / `f32::MAX` ≈ 3.7e-37) it is taken as 0: every
/// `q` is 0. `|q| ≤ 127`, since `a · fl(127 / a)` is 127 within a few ulps. Writes `q` into `out` and
/// returns `dx`.
///
/// # Panics
/// If `x` or `out` is not one super-block long.
#[must_use]
pub fn round_activations(x: &[f32], out: &mut [i8]) -> f32 {
    assert!(x.len() == K_BLOCK_ELEMS && out.len() == K_BLOCK_ELEMS, "one super-block of activations");
    let a = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let inv = 127.0 / a;
    let inv = if inv.is_finite() { inv } else { 0.0 };
    for (q, &v) in out.iter_mut().zip(x) {
        // In range by the bound above, so the cast does not saturate.
        *q = (v * inv).round_ties_even() as i8;
    }
    a / 127.0
}

/// A block-quantised matrix format the executor computes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QFormat {
    /// f16 scale + 32 × i8.
    Q8_0,
    /// f16 scale + 32 × 4-bit unsigned, offset 8.
    Q4_0,
    /// 256-element super-blocks: f16 `d` and `dmin`, 6-bit scale and min per 32 elements, 4-bit quants.
    Q4K,
    /// 256-element super-blocks: 6-bit quants (offset 32), an 8-bit signed scale per 16 elements, f16 `d`.
    Q6K,
    /// 256-element super-blocks: 2-bit quants, a 4-bit scale and 4-bit min per 16 elements, f16 `d`, `dmin`.
    Q2K,
    /// 256-element super-blocks: 3-bit quants (2 low bits and a high-bit mask, offset 4), a 6-bit scale
    /// (offset 32) per 16 elements, f16 `d`.
    Q3K,
}

impl QFormat {
    /// Every format.
    pub const ALL: [QFormat; 6] =
        [QFormat::Q8_0, QFormat::Q4_0, QFormat::Q4K, QFormat::Q6K, QFormat::Q2K, QFormat::Q3K];

    /// The executor format of a core dtype, if it is one of these.
    #[must_use]
    pub fn from_dtype(d: DType) -> Option<QFormat> {
        match d {
            DType::Q8_0 => Some(QFormat::Q8_0),
            DType::Q4_0 => Some(QFormat::Q4_0),
            DType::Q4K => Some(QFormat::Q4K),
            DType::Q6K => Some(QFormat::Q6K),
            DType::Q2K => Some(QFormat::Q2K),
            DType::Q3K => Some(QFormat::Q3K),
            _ => None,
        }
    }

    /// The core dtype.
    #[must_use]
    pub const fn dtype(self) -> DType {
        match self {
            QFormat::Q8_0 => DType::Q8_0,
            QFormat::Q4_0 => DType::Q4_0,
            QFormat::Q4K => DType::Q4K,
            QFormat::Q6K => DType::Q6K,
            QFormat::Q2K => DType::Q2K,
            QFormat::Q3K => DType::Q3K,
        }
    }

    /// Elements per block: [`BLOCK_ELEMS`], or [`K_BLOCK_ELEMS`] for the K-quants.
    #[must_use]
    pub const fn block_elems(self) -> usize {
        match self {
            QFormat::Q8_0 | QFormat::Q4_0 => BLOCK_ELEMS,
            QFormat::Q4K | QFormat::Q6K | QFormat::Q2K | QFormat::Q3K => K_BLOCK_ELEMS,
        }
    }

    /// Whether GEMVs on this format (up to [`EXACT_MAX_TOKENS`] tokens) round the activations first
    /// ([`round_activations`]): q2_k and q3_k.
    #[must_use]
    pub const fn rounds_activations(self) -> bool {
        matches!(self, QFormat::Q2K | QFormat::Q3K)
    }

    /// Bytes per block of [`Self::block_elems`] elements.
    #[must_use]
    pub const fn block_bytes(self) -> usize {
        match self {
            QFormat::Q8_0 => 34,
            QFormat::Q4_0 => 18,
            QFormat::Q4K => 144,
            QFormat::Q6K => 210,
            QFormat::Q2K => 84,
            QFormat::Q3K => 110,
        }
    }

    /// Bytes of a row of `k` elements (`k` a multiple of [`Self::block_elems`]).
    #[must_use]
    pub const fn row_bytes(self, k: usize) -> usize {
        k / self.block_elems() * self.block_bytes()
    }

    /// Quantises `x` (a multiple of [`Self::block_elems`] values) into `out` (`row_bytes(x.len())` bytes).
    ///
    /// # Panics
    /// If the lengths do not match (a caller's bug: shapes are checked when weights are laid out).
    pub fn quantize_row(self, x: &[f32], out: &mut [u8]) {
        let be = self.block_elems();
        assert!(
            x.len().is_multiple_of(be) && out.len() == self.row_bytes(x.len()),
            "quantize_row: {} values into {} bytes of {self:?}",
            x.len(),
            out.len()
        );
        for (xb, ob) in x.chunks_exact(be).zip(out.chunks_exact_mut(self.block_bytes())) {
            match self {
                QFormat::Q8_0 => {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                    ob[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                    for (o, &v) in ob[2..].iter_mut().zip(xb) {
                        // `round` is C's roundf (half away from zero); |v · id| ≤ 127.
                        *o = ((v * id).round() as i8).to_le_bytes()[0];
                    }
                }
                QFormat::Q4_0 => {
                    // The value of largest magnitude, with its sign, maps to −8.
                    let max = xb.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                    let d = max / -8.0;
                    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
                    ob[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                    let (lo, hi) = xb.split_at(BLOCK_ELEMS / 2);
                    for ((o, &a), &b) in ob[2..].iter_mut().zip(lo).zip(hi) {
                        // C truncates `x · id + 8.5` to an integer and clamps it at 15.
                        let q = |v: f32| ((v * id + 8.5) as u8).min(15);
                        *o = q(a) | (q(b) << 4);
                    }
                }
                QFormat::Q4K => quantize_q4_k_block(xb, ob),
                QFormat::Q6K => quantize_q6_k_block(xb, ob),
                QFormat::Q2K => quantize_q2_k_block(xb, ob),
                QFormat::Q3K => quantize_q3_k_block(xb, ob),
            }
        }
    }

    /// Dequantises `blocks` (whole blocks) into `out` ([`Self::block_elems`] values per block).
    ///
    /// # Panics
    /// If the lengths do not match.
    pub fn dequantize_row(self, blocks: &[u8], out: &mut [f32]) {
        let (bb, be) = (self.block_bytes(), self.block_elems());
        assert!(
            blocks.len().is_multiple_of(bb) && out.len() == blocks.len() / bb * be,
            "dequantize_row: {} bytes of {self:?} into {} values",
            blocks.len(),
            out.len()
        );
        for (b, ob) in blocks.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
            let d = f16_at(b, 0);
            match self {
                QFormat::Q8_0 => {
                    for (o, &q) in ob.iter_mut().zip(&b[2..]) {
                        *o = f32::from(i8::from_le_bytes([q])) * d;
                    }
                }
                QFormat::Q4_0 => {
                    let (lo, hi) = ob.split_at_mut(BLOCK_ELEMS / 2);
                    for ((a, c), &q) in lo.iter_mut().zip(hi).zip(&b[2..]) {
                        *a = (f32::from(q & 0x0f) - 8.0) * d;
                        *c = (f32::from(q >> 4) - 8.0) * d;
                    }
                }
                QFormat::Q4K => dequantize_q4_k_block(b, ob),
                QFormat::Q6K => dequantize_q6_k_block(b, ob),
                QFormat::Q2K => dequantize_q2_k_block(b, ob),
                QFormat::Q3K => dequantize_q3_k_block(b, ob),
            }
        }
    }

    /// Quantises a row-major `[rows, k]` f32 matrix.
    #[must_use]
    pub fn quantize(self, x: &[f32], k: usize) -> Vec<u8> {
        let mut out = vec![0u8; x.len() / k * self.row_bytes(k)];
        for (xr, or) in x.chunks_exact(k).zip(out.chunks_exact_mut(self.row_bytes(k))) {
            self.quantize_row(xr, or);
        }
        out
    }

    /// Dequantises a whole `[rows, k]` matrix to f32.
    #[must_use]
    pub fn dequantize(self, blocks: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; blocks.len() / self.block_bytes() * self.block_elems()];
        self.dequantize_row(blocks, &mut out);
        out
    }
}

/// Elements per super-block of the K-quant formats (`QK_K`).
pub const K_BLOCK_ELEMS: usize = 256;

/// Dequantises whole blocks of a GGUF tensor in `dtype` to f32, for the formats the executor reads from files
/// (q8_0, q4_0, q2_k, q3_k, q4_k and q6_k); `None` for another format. K-quant super-blocks follow ggml's
/// `dequantize_row_q*_K`: every product is formed in f32 in the reference's order, without fused
/// multiply-adds.
///
/// # Panics
/// If `raw` is not whole blocks.
#[must_use]
pub fn dequantize_gguf(dtype: DType, raw: &[u8]) -> Option<Vec<f32>> {
    let q = QFormat::from_dtype(dtype)?;
    assert!(raw.len().is_multiple_of(q.block_bytes()), "{} bytes are not whole {dtype} blocks", raw.len());
    Some(q.dequantize(raw))
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a q4_k super-block's 12 packed bytes (ggml's
/// `get_scale_min_k4`): sub-blocks 0..4 in the low 6 bits of bytes j and j + 4, sub-blocks 4..8 in the
/// nibbles of bytes 8..12 with their top 2 bits in the top bits of bytes j − 4 and j.
pub(crate) fn q4_k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// q4_k: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of nibbles.
/// Sub-blocks 2t and 2t + 1 take the low and high nibbles of bytes 32t..32t + 32; value = d·sc·q − dmin·m.
fn dequantize_q4_k_block(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for t in 0..4 {
        for half in 0..2 {
            let (sc, m) = q4_k_scale_min(2 * t + half, scales);
            let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
            for l in 0..32 {
                let q = qs[32 * t + l] >> (4 * half) & 0x0f;
                out[64 * t + 32 * half + l] = d1 * f32::from(q) - m1;
            }
        }
    }
}

/// q6_k: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 signed 8-bit scales (one per 16
/// elements), f16 `d`. Each half of 128 elements takes 64 low bytes, 32 high bytes and 8 scales; its quarter
/// c (32 elements) takes the low (c < 2) or high nibbles of low bytes 32·(c mod 2)…, and bits 2c..2c+2 of the
/// high bytes; value = d·scale·(q − 32).
fn dequantize_q6_k_block(b: &[u8], out: &mut [f32]) {
    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for n in 0..2 {
        for c in 0..4 {
            for l in 0..32 {
                let lo = ql[64 * n + 32 * (c % 2) + l] >> (4 * (c / 2)) & 0x0f;
                let hi = (qh[32 * n + l] >> (2 * c)) & 3;
                let q = i32::from(lo | (hi << 4)) - 32;
                let scale = i8::from_le_bytes([sc[8 * n + l / 16 + 2 * c]]);
                out[128 * n + 32 * c + l] = d * f32::from(scale) * q as f32;
            }
        }
    }
}

/// ggml's `nearest_int`: round to nearest, ties to even (it adds 1.5·2^23 and reads the mantissa).
fn nearest_int(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// ggml's `make_qkx2_quants`: the scale and min (returned as `(scale, −min)`, min ≤ 0) of `x ≈ scale·l + min`
/// with `l` in 0..=nmax, by weighted least squares over `nstep + 1` trial scales around `nmax / (max − min)`,
/// each from the best min so far, the best by weighted squared errors (or absolute ones, `use_mad`); `l`
/// receives the quants of the best.
#[allow(clippy::too_many_arguments)] // the reference's parameters, one for one
fn make_qkx2_quants(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
    l: &mut [u8],
) -> (f32, f32) {
    let (mut min, mut max) = (x[0], x[0]);
    let (mut sum_w, mut sum_x) = (w[0], w[0] * x[0]);
    for (&xi, &wi) in x.iter().zip(w).skip(1) {
        min = if xi < min { xi } else { min };
        max = if xi > max { xi } else { max };
        sum_w += wi;
        sum_x += wi * xi;
    }
    if min > 0.0 {
        min = 0.0;
    }
    #[allow(clippy::float_cmp)] // the reference's test: a constant block has no scale to search
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    // `min` moves to each better trial's, and later trials quantise around it, as in the reference.
    let quant = |iscale: f32, xi: f32, min: f32| nearest_int(iscale * (xi - min)).clamp(0, nmax);
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for ((li, &xi), &wi) in l.iter_mut().zip(x).zip(w) {
        let q = quant(iscale, xi, min);
        *li = q as u8;
        let diff = scale * q as f32 + min - xi;
        best_error += wi * if use_mad { diff.abs() } else { diff * diff };
    }
    let mut aux = [0u8; K_BLOCK_ELEMS];
    let aux = &mut aux[..x.len()];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((a, &xi), &wi) in aux.iter_mut().zip(x).zip(w) {
            let q = quant(iscale, xi, min);
            *a = q as u8;
            let lf = q as f32;
            sum_l += wi * lf;
            sum_l2 += wi * lf * lf;
            sum_xl += wi * lf * xi;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for ((&a, &xi), &wi) in aux.iter().zip(x).zip(w) {
                let diff = this_scale * f32::from(a) + this_min - xi;
                cur_error += wi * if use_mad { diff.abs() } else { diff * diff };
            }
            if cur_error < best_error {
                l.copy_from_slice(aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `quantize_row_q4_K_ref` for one super-block: per sub-block of 32, [`make_qkx2_quants`] with weights
/// `rms(sub-block) + |x|`; scales and mins to 6 bits against the largest of each (`d = max / 63` in f16); then
/// the quants again from the stored scales. A sub-block whose stored scale is 0 keeps its searched quants.
fn quantize_q4_k_block(x: &[f32], out: &mut [u8]) {
    let mut l = [0u8; K_BLOCK_ELEMS];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2 = xs.iter().fold(0f32, |s, &v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut w = [0f32; 32];
        for (wi, &xi) in w.iter_mut().zip(xs) {
            *wi = av_x + xi.abs();
        }
        (scales[j], mins[j]) =
            make_qkx2_quants(xs, &w, 15, -1.0, 0.1, 20, false, &mut l[32 * j..32 * j + 32]);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let packed = &mut out[4..16];
    packed.fill(0);
    for j in 0..8 {
        // C stores the int into a uint8_t (wrapping), then clamps at 63.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    out[..2].copy_from_slice(&f16::from_f32(max_scale / 63.0).to_le_bytes());
    out[2..4].copy_from_slice(&f16::from_f32(max_min / 63.0).to_le_bytes());
    let (d, dmin) = (f16_at(out, 0), f16_at(out, 2));
    for j in 0..8 {
        let (sc, m) = q4_k_scale_min(j, &out[4..16]);
        let ds = d * f32::from(sc);
        if ds == 0.0 {
            continue;
        }
        let dm = dmin * f32::from(m);
        for (li, &xi) in l[32 * j..32 * j + 32].iter_mut().zip(&x[32 * j..]) {
            *li = nearest_int((xi + dm) / ds).clamp(0, 15) as u8;
        }
    }
    for t in 0..4 {
        for i in 0..32 {
            out[16 + 32 * t + i] = l[64 * t + i] | (l[64 * t + 32 + i] << 4);
        }
    }
}

/// The first of `x`'s elements of the largest magnitude, and that magnitude ((0, 0) when every element is 0):
/// the `max` and `amax` ggml's K-quant searches start from.
fn signed_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((0f32, 0f32), |(max, amax), &xi| if xi.abs() > amax { (xi, xi.abs()) } else { (max, amax) })
}

/// ggml's `make_qx_quants` with `rmse_type` 1 and no importance weights: the signed scale of `x ≈ scale·(l −
/// nmax)`, `l` in 0..2·nmax, searched over 19 trial scales by least squares weighted by `x²`.
fn make_qx_quants(x: &[f32], nmax: i32, l: &mut [u8]) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < 1e-15 {
        // GROUP_MAX_EPS: an all-zero group.
        l.fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, xi: f32| nearest_int(iscale * xi).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        x.iter().fold((0f32, 0f32), |(slx, sl2), &xi| {
            let (lf, w) = (quant(iscale, xi) as f32, xi * xi);
            (slx + w * xi * lf, sl2 + w * lf * lf)
        })
    };
    let fill = |iscale: f32, l: &mut [u8]| {
        for (li, &xi) in l.iter_mut().zip(x) {
            *li = (quant(iscale, xi) + nmax) as u8;
        }
    };
    let iscale = -(nmax as f32) / max;
    fill(iscale, l);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 == 0.0 { 0.0 } else { sumlx / suml2 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            fill(iscale, l);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `quantize_row_q6_K_ref` for one super-block: per group of 16, [`make_qx_quants`] (nmax 32); the
/// group scales to 8 bits against the one of largest magnitude (which maps to −128; `d` in f16); then the
/// quants again from the stored scales. A group whose stored scale is 0 keeps its searched quants.
fn quantize_q6_k_block(x: &[f32], out: &mut [u8]) {
    let mut l = [0u8; K_BLOCK_ELEMS];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for (g, s) in scales.iter_mut().enumerate() {
        *s = make_qx_quants(&x[16 * g..16 * g + 16], 32, &mut l[16 * g..16 * g + 16]);
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = *s;
        }
    }
    out.fill(0);
    if max_abs_scale < 1e-15 {
        return;
    }
    let iscale = -128.0 / max_scale;
    out[208..210].copy_from_slice(&f16::from_f32(1.0 / iscale).to_le_bytes());
    let d = f16_at(out, 208);
    for g in 0..16 {
        // At most 127; the largest magnitude maps to −128, which an i8 holds.
        let sc = nearest_int(iscale * scales[g]).min(127) as i8;
        out[192 + g] = sc.to_le_bytes()[0];
        let ds = d * f32::from(sc);
        if ds == 0.0 {
            continue;
        }
        for (li, &xi) in l[16 * g..16 * g + 16].iter_mut().zip(&x[16 * g..]) {
            *li = (nearest_int(xi / ds).clamp(-32, 31) + 32) as u8;
        }
    }
    let (ql, qh) = out[..192].split_at_mut(128);
    for n in 0..2 {
        let ln = &l[128 * n..128 * n + 128];
        for i in 0..32 {
            ql[64 * n + i] = (ln[i] & 0x0f) | ((ln[64 + i] & 0x0f) << 4);
            ql[64 * n + 32 + i] = (ln[32 + i] & 0x0f) | ((ln[96 + i] & 0x0f) << 4);
            qh[32 * n + i] =
                (ln[i] >> 4) | ((ln[32 + i] >> 4) << 2) | ((ln[64 + i] >> 4) << 4) | ((ln[96 + i] >> 4) << 6);
        }
    }
}

/// The quants of a q2_k or q3_k super-block's 64 bytes of 2-bit fields (ggml's layout): element `e` of half
/// `n = e / 128`, quarter `j`, lane `l` (`e = 128n + 32j + l`) sits in bits `2j..2j + 2` of byte `32n + l`.
fn two_bit_quant(qs: &[u8], e: usize) -> u8 {
    (qs[32 * (e / 128) + e % 32] >> (2 * (e % 128 / 32))) & 3
}

/// Packs 256 values 0..=3 into the 64 bytes [`two_bit_quant`] reads.
fn pack_two_bit(l: &[u8], qs: &mut [u8]) {
    for n in 0..2 {
        for i in 0..32 {
            let at = 128 * n + i;
            qs[32 * n + i] = l[at] | (l[at + 32] << 2) | (l[at + 64] << 4) | (l[at + 96] << 6);
        }
    }
}

/// q2_k: 16 bytes of scales (low nibble) and mins (high nibble), one per 16 elements; 64 bytes of 2-bit quants
/// ([`two_bit_quant`]); f16 `d` at 80 and `dmin` at 82. Value = d·sc·q − dmin·m, as ggml's `dequantize_row_q2_K`.
fn dequantize_q2_k_block(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (e, o) in out.iter_mut().enumerate() {
        let sc = b[e / 16];
        let (dl, ml) = (d * f32::from(sc & 0x0f), dmin * f32::from(sc >> 4));
        *o = dl * f32::from(two_bit_quant(&b[16..80], e)) - ml;
    }
}

/// The 16 six-bit scales (0..64, before the offset 32) of a q3_k super-block's 12 packed bytes, as ggml's
/// `dequantize_row_q3_K` unpacks them: scale `j` has its low 4 bits in the low (j < 8) or high nibble of byte
/// `j mod 8`, and its top 2 bits in bits `2·(j / 4)` of byte `8 + j mod 4`.
pub(crate) fn q3_k_scales(packed: &[u8]) -> [u8; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 { packed[j] & 0x0f } else { packed[j - 8] >> 4 };
        low | (((packed[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)
    })
}

/// q3_k: 32 bytes of high-bit mask (element `e`: bit `e / 32` of byte `e mod 32`), 64 bytes of low 2 bits
/// ([`two_bit_quant`]), 12 bytes of 6-bit scales ([`q3_k_scales`]), f16 `d` at 108. Value = d·(sc − 32)·(q − 4)
/// with q = low bits + 4 where the mask bit is set, as ggml's `dequantize_row_q3_K`.
fn dequantize_q3_k_block(b: &[u8], out: &mut [f32]) {
    let (hmask, qs, scales) = (&b[..32], &b[32..96], q3_k_scales(&b[96..108]));
    let d = f16_at(b, 108);
    for (e, o) in out.iter_mut().enumerate() {
        let dl = d * f32::from(i16::from(scales[e / 16]) - 32);
        let high = (hmask[e % 32] >> (e / 32)) & 1;
        let q = i16::from(two_bit_quant(qs, e)) - if high == 1 { 0 } else { 4 };
        *o = dl * f32::from(q);
    }
}

/// ggml's `quantize_row_q2_K_ref` for one super-block: per group of 16, [`make_qkx2_quants`] (nmax 3, weights
/// |x|, absolute errors); scales and mins to 4 bits against the largest of each (`d = max / 15` in f16); then
/// the quants again from the stored scales. A group whose stored scale is 0 keeps its searched quants.
fn quantize_q2_k_block(x: &[f32], out: &mut [u8]) {
    let mut l = [0u8; K_BLOCK_ELEMS];
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let w: [f32; 16] = std::array::from_fn(|i| xs[i].abs());
        (scales[j], mins[j]) = make_qkx2_quants(xs, &w, 3, -0.5, 0.1, 15, true, &mut l[16 * j..16 * j + 16]);
        max_scale = max_scale.max(scales[j]);
        max_min = max_min.max(mins[j]);
    }
    out.fill(0);
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for j in 0..16 {
            out[j] = nearest_int(iscale * scales[j]) as u8;
        }
        out[80..82].copy_from_slice(&f16::from_f32(max_scale / 15.0).to_le_bytes());
    }
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for j in 0..16 {
            out[j] |= (nearest_int(iscale * mins[j]) as u8) << 4;
        }
        out[82..84].copy_from_slice(&f16::from_f32(max_min / 15.0).to_le_bytes());
    }
    let (d, dmin) = (f16_at(out, 80), f16_at(out, 82));
    for j in 0..16 {
        let ds = d * f32::from(out[j] & 0x0f);
        if ds == 0.0 {
            continue;
        }
        let dm = dmin * f32::from(out[j] >> 4);
        for (li, &xi) in l[16 * j..16 * j + 16].iter_mut().zip(&x[16 * j..]) {
            *li = nearest_int((xi + dm) / ds).clamp(0, 3) as u8;
        }
    }
    pack_two_bit(&l, &mut out[16..80]);
}

/// ggml's `make_q3_quants` with `do_rmse`: the signed scale of `x ≈ scale·l`, `l` in −nmax..nmax, from
/// `−nmax / max` and then up to 5 passes that move single quants while the `x²`-weighted fit improves; `l`
/// receives `l + nmax`.
fn make_q3_quants(x: &[f32], nmax: i32, l: &mut [u8]) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < 1e-15 {
        // GROUP_MAX_EPS: an all-zero group.
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut li = [0i32; 16];
    let li = &mut li[..x.len()];
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (q, &xi) in li.iter_mut().zip(x) {
        *q = nearest_int(iscale * xi).clamp(-nmax, nmax - 1);
        let w = xi * xi;
        sumlx += w * xi * *q as f32;
        suml2 += w * *q as f32 * *q as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (q, &xi) in li.iter_mut().zip(x) {
            let w = xi * xi;
            let mut slx = sumlx - w * xi * *q as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * *q as f32 * *q as f32;
                let new_l = nearest_int(xi * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *q {
                    slx += w * xi * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        (*q, sumlx, suml2) = (new_l, slx, sl2);
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for (o, &q) in l.iter_mut().zip(li.iter()) {
        *o = (q + nmax) as u8;
    }
    sumlx / suml2
}

/// ggml's `quantize_row_q3_K_ref` for one super-block: per group of 16, [`make_q3_quants`] (nmax 4); the group
/// scales to 6 bits against the one of largest magnitude (which maps to −32; `d` in f16); then the quants again
/// from the stored scales, split into low bits and the high-bit mask. A group whose stored scale is 0 keeps its
/// searched quants.
fn quantize_q3_k_block(x: &[f32], out: &mut [u8]) {
    let mut l = [0u8; K_BLOCK_ELEMS];
    let mut scales = [0f32; 16];
    for (j, s) in scales.iter_mut().enumerate() {
        *s = make_q3_quants(&x[16 * j..16 * j + 16], 4, &mut l[16 * j..16 * j + 16]);
    }
    let (max_scale, _) = signed_max(&scales);
    out.fill(0);
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        let packed = &mut out[96..108];
        for (j, &s) in scales.iter().enumerate() {
            // C stores the int into an int8_t (wrapping), then clamps to −32..=31.
            let v = (i32::from(nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                packed[j] = v & 0x0f;
            } else {
                packed[j - 8] |= (v & 0x0f) << 4;
            }
            packed[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
        }
        out[108..110].copy_from_slice(&f16::from_f32(1.0 / iscale).to_le_bytes());
    }
    let (d, sc) = (f16_at(out, 108), q3_k_scales(&out[96..108]));
    for j in 0..16 {
        let ds = d * f32::from(i16::from(sc[j]) - 32);
        if ds == 0.0 {
            continue;
        }
        for (li, &xi) in l[16 * j..16 * j + 16].iter_mut().zip(&x[16 * j..]) {
            *li = (nearest_int(xi / ds).clamp(-4, 3) + 4) as u8;
        }
    }
    // Values 4..8 set their bit in the mask (element e: bit e / 32 of byte e mod 32) and keep 0..4.
    for (e, li) in l.iter_mut().enumerate() {
        if *li > 3 {
            out[e % 32] |= 1 << (e / 32);
            *li -= 4;
        }
    }
    pack_two_bit(&l, &mut out[32..96]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `round_activations` of a block that is `head` then zeros.
    fn rounded(head: &[f32]) -> (Vec<i8>, f32) {
        let mut x = [0f32; K_BLOCK_ELEMS];
        x[..head.len()].copy_from_slice(head);
        let mut q = [0i8; K_BLOCK_ELEMS];
        let dx = round_activations(&x, &mut q);
        assert!(q[head.len()..].iter().all(|&v| v == 0));
        (q[..head.len()].to_vec(), dx)
    }

    #[test]
    #[allow(clippy::float_cmp)] // every value here is exact
    fn activations_round_to_nearest_even_against_the_largest_magnitude() {
        // Largest magnitude 127: 127 / a is 1, so the halves are exact ties, which go to the even neighbour.
        let (q, dx) = rounded(&[127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -1.5, 0.49, -126.5]);
        assert_eq!((q, dx), (vec![127, 2, 4, -2, 0, 0, 2, -2, 0, -126], 1.0));
        // Largest magnitude −254: 127 / a is 0.5; x · 0.5 gives ties at 0.5, 1.5, −2.5; both signs of the extreme.
        let (q, dx) = rounded(&[-254.0, 1.0, 3.0, -5.0, 254.0, 253.0]);
        assert_eq!((q, dx), (vec![-127, 0, 2, -2, 127, 126], 2.0));
        // A zero block: every q 0 and dx 0.
        assert_eq!(rounded(&[]), (vec![], 0.0));
        // A tiny block: 127 / a overflows (a < 127 / f32::MAX), so every q is 0, dx is still a / 127.
        let (q, dx) = rounded(&[1e-38, -3e-37]);
        assert_eq!((q, dx), (vec![0, 0], 3e-37 / 127.0));
        // Just above that guard, and at a scale with an inexact 127 / a: the extremes are ±127 and the rest
        // within half a step, computed as the product x · fl(127 / a) (here 0.1 · fl(127 / 0.3) = 42.333…,
        // not 0.1 · 127 / 0.3 in two roundings; both give 42).
        let (q, _) = rounded(&[4e-37, -2e-37]);
        assert_eq!(q, vec![127, -64]);
        let (q, dx) = rounded(&[0.3, -0.1, 0.15, -0.3]);
        assert_eq!((q, dx), (vec![127, -42, 64, -127], 0.3 / 127.0));
    }

    fn block(d: f32, quants: &[u8]) -> Vec<u8> {
        let mut b = f16::from_f32(d).to_le_bytes().to_vec();
        b.extend_from_slice(quants);
        b
    }

    #[test]
    #[allow(clippy::float_cmp)] // dequantised values are exact products of small integers and an f16
    fn hand_made_q8_0_block_dequantises_to_q_times_d() {
        // d = 0.5 (exact in f16); quants −128, −1, 0, 1, 127, then j − 16 for the rest.
        let mut q: Vec<u8> = (0..32).map(|j| ((j as i8) - 16).to_le_bytes()[0]).collect();
        q[..5].copy_from_slice(&[0x80, 0xff, 0x00, 0x01, 0x7f]);
        let out = QFormat::Q8_0.dequantize(&block(0.5, &q));
        assert_eq!(&out[..5], &[-64.0, -0.5, 0.0, 0.5, 63.5]);
        for (j, &v) in out.iter().enumerate().skip(5) {
            assert_eq!(v, (j as f32 - 16.0) * 0.5, "element {j}");
        }
    }

    #[test]
    #[allow(clippy::float_cmp)]
    fn hand_made_q4_0_block_puts_low_nibbles_first() {
        // Byte j = (high 15 − j) << 4 | low j: element j is (j − 8)·d, element 16 + j is (7 − j)·d.
        let q: Vec<u8> = (0..16u8).map(|j| ((15 - j) << 4) | j).collect();
        let out = QFormat::Q4_0.dequantize(&block(0.25, &q));
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.25, "low nibble {j}");
            assert_eq!(out[16 + j], (7.0 - j as f32) * 0.25, "high nibble {j}");
        }
        // The scale is stored in f16: 0.1 is rounded (0.0999755859375), and that is what multiplies.
        let d16 = f16::from_f32(0.1).to_f32();
        assert_eq!(QFormat::Q4_0.dequantize(&block(0.1, &[0x9f; 16]))[0], 7.0 * d16);
    }

    #[test]
    #[allow(clippy::float_cmp)] // −0.5 is exact in f16
    fn quantisers_follow_the_reference_rules() {
        // q8_0: the largest magnitude maps to ±127, d = amax / 127.
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 12.0) * 0.3).collect();
        let b = QFormat::Q8_0.quantize(&x, 32);
        let d = 19.0 * 0.3 / 127.0;
        assert_eq!(f16::from_le_bytes([b[0], b[1]]), f16::from_f32(d));
        assert_eq!(i8::from_le_bytes([b[2 + 31]]), 127);
        assert_eq!(i8::from_le_bytes([b[2]]), (-12.0f32 * 0.3 / d).round() as i8);
        // q4_0: the signed maximum maps to nibble 0 (value −8·d), so d = max / −8 (negative here).
        let mut y = [0.1f32; 32];
        y[20] = 4.0;
        y[3] = -1.0;
        let b = QFormat::Q4_0.quantize(&y, 32);
        assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), -0.5);
        assert_eq!(b[2 + 4] >> 4, 0, "element 20 is the high nibble of byte 4");
        assert_eq!(b[2 + 3] & 0x0f, 10, "−1 / −0.5 + 8.5 = 10.5 truncates to 10");
        assert_eq!(b[2] & 0x0f, 8, "0.1 / −0.5 + 8.5 = 8.3 truncates to 8");
        // An all-zero block has d = 0 and dequantises to zeros.
        let z = QFormat::Q4_0.quantize(&[0.0; 32], 32);
        assert!(QFormat::Q4_0.dequantize(&z).iter().all(|&v| v == 0.0));
    }

    #[test]
    #[allow(clippy::float_cmp)] // powers of two times small integers: exact
    fn hand_made_q4_k_block_dequantises_per_sub_block() {
        // d = 0.5, dmin = 0.25; sub-block s has scale 3 + 7s and min 60 − 5s (6 bits; sub-blocks 4..8 need
        // their top 2 bits, which the packing keeps in bytes 0..8).
        let (sc, mn): (Vec<u8>, Vec<u8>) = (0..8u8).map(|s| (3 + 7 * s, 60 - 5 * s)).unzip();
        let mut packed = [0u8; 12];
        for j in 0..4 {
            packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            packed[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            packed[j + 8] = (sc[j + 4] & 0x0f) | ((mn[j + 4] & 0x0f) << 4);
        }
        let qs: Vec<u8> = (0..128u32).map(|i| ((i * 7 + 3) % 256) as u8).collect();
        let mut b = f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend(f16::from_f32(0.25).to_le_bytes());
        b.extend(packed);
        b.extend(&qs);
        let out = dequantize_gguf(DType::Q4K, &b).unwrap();
        assert_eq!(out.len(), 256);
        for (i, &v) in out.iter().enumerate() {
            let s = i / 32;
            let byte = qs[32 * (s / 2) + i % 32];
            let q = if s % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            let want = 0.5 * f32::from(sc[s]) * f32::from(q) - 0.25 * f32::from(mn[s]);
            assert_eq!(v, want, "element {i} (sub-block {s})");
        }
    }

    #[test]
    #[allow(clippy::float_cmp)]
    fn hand_made_q6_k_block_dequantises_per_sixteen() {
        // d = 0.125; scales −8..8 (signed); low nibbles and high pairs from two patterns.
        let ql: Vec<u8> = (0..128u32).map(|i| ((i * 37 + 11) % 256) as u8).collect();
        let qh: Vec<u8> = (0..64u32).map(|i| ((i * 101 + 5) % 256) as u8).collect();
        let sc: Vec<i8> = (0..16i8).map(|i| i - 8).collect();
        let mut b = ql.clone();
        b.extend(&qh);
        b.extend(sc.iter().map(|&s| s.to_le_bytes()[0]));
        b.extend(f16::from_f32(0.125).to_le_bytes());
        let out = dequantize_gguf(DType::Q6K, &b).unwrap();
        for (i, &v) in out.iter().enumerate() {
            // Element i: half n, quarter c, lane l; 6-bit q = low nibble | high pair << 4, offset 32.
            let (n, c, l) = (i / 128, i % 128 / 32, i % 32);
            let low_byte = ql[64 * n + 32 * (c % 2) + l];
            let lo = if c < 2 { low_byte & 0x0f } else { low_byte >> 4 };
            let hi = (qh[32 * n + l] >> (2 * c)) & 3;
            let q = f32::from(lo | (hi << 4)) - 32.0;
            let scale = f32::from(sc[8 * n + 2 * c + l / 16]);
            assert_eq!(v, 0.125 * scale * q, "element {i}");
        }
        // Other formats: q4_0 as its own dequantiser, unknown ones none.
        let q4 = QFormat::Q4_0.quantize(&[0.5; 32], 32);
        assert_eq!(dequantize_gguf(DType::Q4_0, &q4), Some(QFormat::Q4_0.dequantize(&q4)));
        assert_eq!(dequantize_gguf(DType::Q5K, &[0; 176]), None);
    }

    #[test]
    #[allow(clippy::float_cmp)] // powers of two times small integers: exact
    fn hand_made_q2_k_block_dequantises_per_sixteen() {
        // Scale/min byte s: scale s % 16, min 15 − s; 2-bit quants from a pattern; d = 0.5, dmin = 0.25.
        let sm: Vec<u8> = (0..16u8).map(|s| (s % 16) | ((15 - s) << 4)).collect();
        let qs: Vec<u8> = (0..64u32).map(|i| ((i * 73 + 29) % 256) as u8).collect();
        let mut b = sm.clone();
        b.extend(&qs);
        b.extend(f16::from_f32(0.5).to_le_bytes());
        b.extend(f16::from_f32(0.25).to_le_bytes());
        let out = dequantize_gguf(DType::Q2K, &b).unwrap();
        for (i, &v) in out.iter().enumerate() {
            // Element i: half n, quarter j (bits 2j..2j+2), lane l of byte 32n + l; group i / 16.
            let (n, j, l) = (i / 128, i % 128 / 32, i % 32);
            let q = (qs[32 * n + l] >> (2 * j)) & 3;
            let g = sm[i / 16];
            let want = 0.5 * f32::from(g & 15) * f32::from(q) - 0.25 * f32::from(g >> 4);
            assert_eq!(v, want, "element {i}");
        }
    }

    #[test]
    #[allow(clippy::float_cmp)]
    fn hand_made_q3_k_block_dequantises_per_sixteen() {
        // 6-bit scales 4s + 1 (s = 0..16, so 1..61: the top 2 bits matter); d = 0.125.
        let sc: Vec<u8> = (0..16u8).map(|s| 4 * s + 1).collect();
        let mut packed = [0u8; 12];
        for (j, &v) in sc.iter().enumerate() {
            if j < 8 {
                packed[j] |= v & 15;
            } else {
                packed[j - 8] |= (v & 15) << 4;
            }
            packed[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
        }
        let hmask: Vec<u8> = (0..32u32).map(|i| ((i * 151 + 7) % 256) as u8).collect();
        let qs: Vec<u8> = (0..64u32).map(|i| ((i * 89 + 13) % 256) as u8).collect();
        let mut b = hmask.clone();
        b.extend(&qs);
        b.extend(packed);
        b.extend(f16::from_f32(0.125).to_le_bytes());
        assert_eq!(q3_k_scales(&packed).to_vec(), sc);
        let out = dequantize_gguf(DType::Q3K, &b).unwrap();
        for (i, &v) in out.iter().enumerate() {
            let (n, j, l) = (i / 128, i % 128 / 32, i % 32);
            let low = (qs[32 * n + l] >> (2 * j)) & 3;
            // The mask bit set means q = low bits; clear means low bits − 4.
            let q = f32::from(low) - if (hmask[l] >> (4 * n + j)) & 1 == 1 { 0.0 } else { 4.0 };
            let want = 0.125 * (f32::from(sc[i / 16]) - 32.0) * q;
            assert_eq!(v, want, "element {i}");
        }
    }

    #[test]
    fn low_bit_k_quants_round_trip_within_their_scale_steps() {
        let x = k_quant_rows();
        // Per group of 16: q2_k has 3 steps over [min(0, lo), hi], q3_k 4 steps over the largest magnitude.
        // Their group scales are 4 or 6 bits against the super-block's largest, so a group far below it loses
        // up to half a scale step on every quant: bound each group by a step of its own plus that loss.
        for (f, levels, scale_levels) in [(QFormat::Q2K, 3.0, 15.0), (QFormat::Q3K, 4.0, 32.0)] {
            let back = f.dequantize(&f.quantize(&x, 512));
            for (c, (xs, bs)) in x.chunks(256).zip(back.chunks(256)).enumerate() {
                let groups: Vec<(f32, f32)> = xs
                    .chunks(16)
                    .map(|g| {
                        let (lo, hi) = g.iter().fold((0f32, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
                        if f == QFormat::Q2K { ((hi - lo) / levels, -lo) } else { (amax / levels, 0.0) }
                    })
                    .collect();
                let top_step = groups.iter().fold(0f32, |m, g| m.max(g.0));
                let top_min = groups.iter().fold(0f32, |m, g| m.max(g.1));
                let (mut sq, mut sq_x) = (0f32, 0f32);
                for ((xg, bg), &(step, _)) in xs.chunks(16).zip(bs.chunks(16)).zip(&groups) {
                    let slack = levels * top_step / scale_levels + top_min / scale_levels;
                    for (a, b) in xg.iter().zip(bg) {
                        assert!(
                            (a - b).abs() <= step + slack,
                            "{f:?}: {a} → {b}, step {step}, slack {slack}"
                        );
                        sq += (a - b) * (a - b);
                        sq_x += a * a;
                    }
                }
                // Uniformly spread values (all but the outlier super-blocks, c mod 4 = 2) leave rounding noise of
                // step²/12 against a spread of (3 steps)²/12 for q2_k: 1/9 of the values' energy, less for q3_k.
                if c % 4 != 2 {
                    assert!(sq < 0.15 * sq_x, "{f:?}: error energy {sq} of {sq_x} in super-block {c}");
                }
            }
            assert!(f.dequantize(&f.quantize(&[0.0; 256], 256)).iter().all(|&v| v == 0.0), "{f:?}");
        }
    }

    #[test]
    fn low_bit_k_quant_scales_follow_the_reference_rules() {
        let x = k_quant_rows();
        // q2_k: the largest group scale and min take 4-bit value 15.
        let b = QFormat::Q2K.quantize(&x[256..512], 256);
        assert_eq!(b[..16].iter().map(|&s| s & 15).max(), Some(15));
        assert_eq!(b[..16].iter().map(|&s| s >> 4).max(), Some(15), "this block has negative values: mins");
        // q3_k: the group scale of largest magnitude maps to 6-bit 0 (−32 after the offset).
        let b = QFormat::Q3K.quantize(&x[512..768], 256);
        let sc = q3_k_scales(&b[96..108]);
        assert!(sc.contains(&0), "{sc:?}");
        // Outliers (·40) and small values (·0.01) share d: the small groups keep nonzero scales.
        assert!(sc.iter().all(|&s| s != 32), "{sc:?}");
    }

    /// Rows of the shapes weights take: small and large magnitudes, an outlier group, one-signed blocks.
    fn k_quant_rows() -> Vec<f32> {
        (0..256 * 24u32)
            .map(|i| {
                let v = (i.wrapping_mul(2_654_435_761) >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0;
                match i / 256 % 4 {
                    0 => v * 0.05,
                    1 => v * 3.0 + 0.5,
                    2 if i % 7 == 0 => v * 40.0,
                    2 => v * 0.01,
                    _ => v.abs() * 2.0,
                }
            })
            .collect()
    }

    #[test]
    fn k_quant_round_trip_error_is_within_a_step_and_half_a_step_on_average() {
        let x = k_quant_rows();
        for (f, group) in [(QFormat::Q4K, 32), (QFormat::Q6K, 16)] {
            let blocks = f.quantize(&x, 512);
            assert_eq!(blocks.len(), x.len() / 256 * f.block_bytes());
            let back = f.dequantize(&blocks);
            for (xg, bg) in x.chunks(group).zip(back.chunks(group)) {
                // q4_k: 15 steps over [min(0, lo), hi]; q6_k: 32 steps over the largest magnitude.
                let (lo, hi) = xg.iter().fold((0f32, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
                let step = if f == QFormat::Q4K { (hi - lo) / 15.0 } else { amax / 32.0 };
                let (mut worst, mut sq) = (0f32, 0f32);
                for (a, b) in xg.iter().zip(bg) {
                    worst = worst.max((a - b).abs());
                    sq += (a - b) * (a - b);
                }
                let rms = (sq / group as f32).sqrt();
                assert!(worst <= step * 1.01, "{f:?}: error {worst} over a step {step}");
                // Rounding to the nearest level leaves step/√12 on average; the scale search does at least that.
                assert!(rms <= step * 0.35, "{f:?}: rms error {rms}, step {step}");
                assert!(worst > 0.0, "{f:?}: random values are not all representable");
            }
        }
        // All-zero super-blocks quantise to zeros (q6_k's scale search has nothing to fit).
        for f in [QFormat::Q4K, QFormat::Q6K] {
            assert!(f.dequantize(&f.quantize(&[0.0; 256], 256)).iter().all(|&v| v == 0.0), "{f:?}");
        }
    }

    #[test]
    fn k_quant_scales_follow_the_reference_rules() {
        let x = k_quant_rows();
        // q4_k: the largest sub-block scale and min take 6-bit value 63, d = max scale / 63.
        let b = QFormat::Q4K.quantize(&x[256..512], 256);
        let sm: Vec<(u8, u8)> = (0..8).map(|j| q4_k_scale_min(j, &b[4..16])).collect();
        assert_eq!(sm.iter().map(|s| s.0).max(), Some(63));
        assert_eq!(sm.iter().map(|s| s.1).max(), Some(63), "this block has negative values: mins");
        // Its values are 3·U(−1, 1) + 0.5: the scale is about (3.5 + 2.5) / 15 per step.
        let d = f16_at(&b, 0) * 63.0;
        assert!((d - 6.0 / 15.0).abs() < 0.05, "largest sub-block scale {d}");
        // q6_k: the group scale of largest magnitude maps to −128 (d = −max / 128, so d·sc keeps its sign).
        let b = QFormat::Q6K.quantize(&x[512..768], 256);
        let sc: Vec<i8> = b[192..208].iter().map(|&v| i8::from_le_bytes([v])).collect();
        assert!(sc.contains(&-128), "{sc:?}");
        // One block stores the outliers (·40) and the small values (·0.01) with the same d: small groups
        // get small scales, not zero ones.
        assert!(sc.iter().all(|&s| s != 0), "{sc:?}");
    }

    #[test]
    fn round_trip_error_is_within_half_a_step_but_at_q4_0s_clamped_end() {
        let x: Vec<f32> = (0..256).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 3.0).collect();
        for f in [QFormat::Q8_0, QFormat::Q4_0] {
            let back = f.dequantize(&f.quantize(&x, 64));
            for (xb, bb) in x.chunks(32).zip(back.chunks(32)) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                // q4_0 maps the signed maximum to −8, so the opposite end (+8) clamps to 7: a whole step.
                let (step, max_steps) = match f {
                    QFormat::Q8_0 => (amax / 127.0, 0.5),
                    _ => (amax / 8.0, 1.0),
                };
                let mut worst = 0f32;
                for (a, b) in xb.iter().zip(bb) {
                    // Plus the f16 rounding of the scale times the largest quant.
                    assert!(
                        (a - b).abs() <= max_steps * step + amax * 1e-3,
                        "{f:?} {a} vs {b} (step {step})"
                    );
                    worst = worst.max((a - b).abs());
                }
                assert!(worst > 0.0, "{f:?}: random values are not all representable");
            }
        }
    }
}
