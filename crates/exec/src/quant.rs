//! Block-quantised matrix formats, bit-exact with GGUF: `q8_0` (an f16 scale `d` and 32 signed bytes,
//! value = `q · d`) and `q4_0` (an f16 scale `d` and 16 bytes of nibbles, value = `(q − 8) · d`; the low nibble
//! of byte `j` is element `j`, the high nibble element `j + 16`). A row of `k` elements is `k / 32` blocks
//! laid out back to back, so a matrix is its rows' blocks in row order, as in a GGUF file.
//!
//! [`QFormat::quantize_row`] follows ggml's reference quantisers (`quantize_row_q8_0_ref`,
//! `quantize_row_q4_0_ref`): the scale is computed in f32 from the block's largest magnitude and stored rounded
//! to f16, while the quants are computed with the unrounded f32 scale. [`QFormat::dequantize_row`] is ggml's
//! `dequantize_row_q8_0` / `dequantize_row_q4_0`: the product of a small integer and an f16 is exact in f32,
//! so dequantised values are exact.

use half::f16;
use pipeshard_core::dtype::DType;

/// Elements per block of every format here.
pub const BLOCK_ELEMS: usize = 32;

/// The most tokens a quantised matmul takes with exactly dequantised (f32) weights, as a GEMV that
/// dequantises while it reads. With more tokens (prefill), CPU and GPU alike first dequantise the weights to
/// bf16 (the activation type of quantised models) and run a bf16 GEMM, so both sides compute the same function
/// for every token count.
pub const EXACT_MAX_TOKENS: usize = 8;

/// A block-quantised matrix format the executor computes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QFormat {
    /// f16 scale + 32 × i8.
    Q8_0,
    /// f16 scale + 32 × 4-bit unsigned, offset 8.
    Q4_0,
}

impl QFormat {
    /// Both formats.
    pub const ALL: [QFormat; 2] = [QFormat::Q8_0, QFormat::Q4_0];

    /// The executor format of a core dtype, if it is one of these.
    #[must_use]
    pub fn from_dtype(d: DType) -> Option<QFormat> {
        match d {
            DType::Q8_0 => Some(QFormat::Q8_0),
            DType::Q4_0 => Some(QFormat::Q4_0),
            _ => None,
        }
    }

    /// The core dtype.
    #[must_use]
    pub const fn dtype(self) -> DType {
        match self {
            QFormat::Q8_0 => DType::Q8_0,
            QFormat::Q4_0 => DType::Q4_0,
        }
    }

    /// Bytes per block of [`BLOCK_ELEMS`] elements.
    #[must_use]
    pub const fn block_bytes(self) -> usize {
        match self {
            QFormat::Q8_0 => 34,
            QFormat::Q4_0 => 18,
        }
    }

    /// Bytes of a row of `k` elements (`k` a multiple of [`BLOCK_ELEMS`]).
    #[must_use]
    pub const fn row_bytes(self, k: usize) -> usize {
        k / BLOCK_ELEMS * self.block_bytes()
    }

    /// Quantises `x` (a multiple of [`BLOCK_ELEMS`] values) into `out` (`row_bytes(x.len())` bytes).
    ///
    /// # Panics
    /// If the lengths do not match (a caller's bug: shapes are checked when weights are laid out).
    pub fn quantize_row(self, x: &[f32], out: &mut [u8]) {
        assert!(
            x.len().is_multiple_of(BLOCK_ELEMS) && out.len() == self.row_bytes(x.len()),
            "quantize_row: {} values into {} bytes of {self:?}",
            x.len(),
            out.len()
        );
        for (xb, ob) in x.chunks_exact(BLOCK_ELEMS).zip(out.chunks_exact_mut(self.block_bytes())) {
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
            }
        }
    }

    /// Dequantises `blocks` (whole blocks) into `out` (`BLOCK_ELEMS` values per block).
    ///
    /// # Panics
    /// If the lengths do not match.
    pub fn dequantize_row(self, blocks: &[u8], out: &mut [f32]) {
        let bb = self.block_bytes();
        assert!(
            blocks.len().is_multiple_of(bb) && out.len() == blocks.len() / bb * BLOCK_ELEMS,
            "dequantize_row: {} bytes of {self:?} into {} values",
            blocks.len(),
            out.len()
        );
        for (b, ob) in blocks.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK_ELEMS)) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
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
        let mut out = vec![0f32; blocks.len() / self.block_bytes() * BLOCK_ELEMS];
        self.dequantize_row(blocks, &mut out);
        out
    }
}

/// Elements per super-block of the K-quant formats (`QK_K`).
pub const K_BLOCK_ELEMS: usize = 256;

/// Dequantises whole blocks of a GGUF tensor in `dtype` to f32, for the formats the executor reads from files
/// (q8_0, q4_0, and the K-quants q4_k and q6_k, which it converts as they load); `None` for another format.
/// K-quant super-blocks follow ggml's `dequantize_row_q4_K` / `dequantize_row_q6_K`: every product is formed
/// in f32 in the reference's order, without fused multiply-adds.
///
/// # Panics
/// If `raw` is not whole blocks.
#[must_use]
pub fn dequantize_gguf(dtype: DType, raw: &[u8]) -> Option<Vec<f32>> {
    let per_block = |bb: usize, f: fn(&[u8], &mut [f32])| {
        assert!(raw.len().is_multiple_of(bb), "{} bytes are not whole {dtype} blocks", raw.len());
        let mut out = vec![0f32; raw.len() / bb * K_BLOCK_ELEMS];
        for (b, o) in raw.chunks_exact(bb).zip(out.chunks_exact_mut(K_BLOCK_ELEMS)) {
            f(b, o);
        }
        out
    };
    match dtype {
        DType::Q4K => Some(per_block(144, dequantize_q4_k_block)),
        DType::Q6K => Some(per_block(210, dequantize_q6_k_block)),
        _ => QFormat::from_dtype(dtype).map(|q| q.dequantize(raw)),
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a q4_k super-block's 12 packed bytes (ggml's
/// `get_scale_min_k4`): sub-blocks 0..4 in the low 6 bits of bytes j and j + 4, sub-blocks 4..8 in the
/// nibbles of bytes 8..12 with their top 2 bits in the top bits of bytes j − 4 and j.
fn q4_k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(dequantize_gguf(DType::Q2K, &[0; 84]), None);
    }

    #[test]
    fn round_trip_error_is_within_half_a_step_but_at_q4_0s_clamped_end() {
        let x: Vec<f32> = (0..256).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 3.0).collect();
        for f in QFormat::ALL {
            let back = f.dequantize(&f.quantize(&x, 64));
            for (xb, bb) in x.chunks(32).zip(back.chunks(32)) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                // q4_0 maps the signed maximum to −8, so the opposite end (+8) clamps to 7: a whole step.
                let (step, max_steps) = match f {
                    QFormat::Q8_0 => (amax / 127.0, 0.5),
                    QFormat::Q4_0 => (amax / 8.0, 1.0),
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
