//! The vision encoder of a VLM (Qwen2.5-VL): image → patch grid → LLM tokens, the encoder's ops, and the VRAM
//! its attention needs with and without flash attention or query tiling.
//!
//! What is modelled is what llama.cpp's `clip.cpp` (b6097, the paper's fork) runs, not the ideal kernel:
//! - the image is scaled so that its longer side is at most `max_side_px` (never up), then each side is rounded
//!   **up** to a multiple of `patch × spatial_merge` (28 px); every 14-px patch is a position of the encoder,
//!   and every 2×2 square of patches is one LLM token;
//! - windowed blocks attend over **all** positions with an `N × N` f32 mask (−∞ outside the window), so every
//!   block does `N²` work and the mask alone is `4 N²` bytes; the full-attention blocks have no mask;
//! - without flash attention a block materialises its `heads × N × N` f32 scores (softmax runs in place);
//!   with it the scores never exist, but the mask is also cast to f16 (`2 N²` more bytes);
//! - query tiling (the paper's VLMOpt) cuts the queries into tiles of `q_tile` rows, chosen from a budget as
//!   the paper does ([`q_tile_for_budget`]), so at most `heads × q_tile × N` scores exist at once.

use serde::{Deserialize, Serialize};

use crate::dtype::DType;
use crate::inventory::{Inventory, UnitId};
use crate::model::{ModelSpec, VisionConfig};
use crate::workload::{ACT_BYTES, Op, OpKind};

/// The encoder's input after resizing: pixel size and patch grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageGrid {
    pub width_px: u64,
    pub height_px: u64,
    pub patches_wide: u64,
    pub patches_high: u64,
    /// Side of the square of patches merged into one LLM token.
    pub spatial_merge: u64,
}

/// An image the encoder cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VisionError {
    #[error("image: `{field}` = {value} is out of range; expected {expected}")]
    Image { field: &'static str, value: u64, expected: String },
    #[error("model `{model}` has no vision encoder; pick a VLM such as cosmos-reason1-7b")]
    NoEncoder { model: String },
}

/// Largest image side accepted (pixels): bounds `N²` of the encoder's attention to 64-bit arithmetic.
pub const MAX_SIDE_PX: u64 = 1 << 15;

/// An image as the user gives it, and the longer side the encoder may see (llama.cpp `-cis`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceImage {
    pub width_px: u64,
    pub height_px: u64,
    pub max_side_px: u64,
}

/// With flash attention the fork aligns each side to this many merge squares (8 × 28 px), so that the
/// position count is a multiple of 256 as CUDA's flash-attention kernels need.
pub const FLASH_ALIGN_MERGES: u64 = 8;

impl ImageGrid {
    /// The grid of `image` scaled to at most `max_side_px` on its longer side (never up), each side then
    /// rounded up to a multiple of `patch × spatial_merge` — and of [`FLASH_ALIGN_MERGES`] times that when the
    /// encoder runs flash attention (`flash_aligned`), as the paper's fork does.
    pub fn fit(v: &VisionConfig, image: SourceImage, flash_aligned: bool) -> Result<ImageGrid, VisionError> {
        for (field, value) in
            [("width_px", image.width_px), ("height_px", image.height_px), ("max_side_px", image.max_side_px)]
        {
            if value == 0 || value > MAX_SIDE_PX {
                return Err(VisionError::Image {
                    field,
                    value,
                    expected: format!("1..={MAX_SIDE_PX} pixels"),
                });
            }
        }
        let max_side = image.max_side_px as f64;
        let scale = (max_side / image.width_px as f64).min(max_side / image.height_px as f64).min(1.0);
        let align = v.patch * v.spatial_merge;
        let flash = if flash_aligned { align * FLASH_ALIGN_MERGES } else { align };
        // clip.cpp truncates the scaled size to whole pixels, then aligns up.
        let side = |px: u64| {
            ((px as f64 * scale) as u64).max(1).div_ceil(align).saturating_mul(align).div_ceil(flash) * flash
        };
        let (w, h) = (side(image.width_px), side(image.height_px));
        Ok(ImageGrid {
            width_px: w,
            height_px: h,
            patches_wide: w / v.patch,
            patches_high: h / v.patch,
            spatial_merge: v.spatial_merge,
        })
    }

    /// Positions of the encoder (14-px patches).
    #[must_use]
    pub fn patches(&self) -> u64 {
        self.patches_wide * self.patches_high
    }

    /// LLM tokens the image becomes after the `spatial_merge × spatial_merge` merge.
    #[must_use]
    pub fn tokens(&self) -> u64 {
        self.patches() / (self.spatial_merge * self.spatial_merge)
    }
}

/// How the encoder's attention runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VisionAttention {
    /// Scores materialised whole (`heads × N × N` f32): stock llama.cpp.
    Materialised,
    /// Flash attention over the whole sequence (`MTMD_CLIP_FLASH_ATTN=1`): no scores in memory.
    Flash,
    /// Scores materialised one tile of `q_tile` queries at a time (VLMOpt's tiled-Q attention).
    TiledQ { q_tile: u64 },
}

/// Tile of queries that keeps one tile's f32 scores (`4 × heads × q_tile × N` bytes) within `budget_bytes`, as
/// the paper's fork chooses it: at least 64, rounded up to a multiple of 64, at most `N`; a tile of `N` means
/// no tiling. Its clamp to keep mask copies under ggml's 2 GiB tensor limit is applied too.
#[must_use]
pub fn q_tile_for_budget(v: &VisionConfig, positions: u64, budget_bytes: u64) -> u64 {
    let n = positions.max(1);
    let mut q = (budget_bytes / (4 * u64::from(v.n_heads) * n)).max(64).min(n);
    let mask_rows = (i32::MAX as u64 / (n * 4)) & !63;
    q = q.min(mask_rows.max(64));
    q.div_ceil(64).saturating_mul(64).min(n)
}

/// Bytes of the encoder's compute buffer at its peak over one block (what ggml's allocator reserves), for
/// `positions` positions: the window mask (and its f16 copy under flash attention), the residual and normed
/// hidden states, and the larger of the attention temporaries (Q, K, V, output, scores or one tile of them)
/// and the MLP's (gate and up).
#[must_use]
pub fn encoder_scratch_bytes(v: &VisionConfig, positions: u64, attention: VisionAttention) -> u64 {
    let n = positions as f64;
    let w = v.width as f64;
    let heads = f64::from(v.n_heads);
    let windowed = (v.full_attn_blocks.len() as u32) < v.depth;
    let mask = if windowed {
        4.0 * n * n + if attention == VisionAttention::Flash { 2.0 * n * n } else { 0.0 }
    } else {
        0.0
    };
    let hidden = ACT_BYTES * n * w;
    let scores = match attention {
        VisionAttention::Materialised => ACT_BYTES * heads * n * n,
        VisionAttention::Flash => 0.0,
        // One tile's scores plus the concatenated tile outputs.
        VisionAttention::TiledQ { q_tile } => ACT_BYTES * heads * q_tile.min(positions) as f64 * n + hidden,
    };
    let attn = 4.0 * hidden + scores;
    let mlp = 2.0 * ACT_BYTES * n * v.mlp as f64;
    (mask + 2.0 * hidden + attn.max(mlp)) as u64
}

/// Every op of one image's encode, in execution order: patch embedding, per block (norm, QKV, RoPE,
/// attention over all `N` positions, output, residual, norm, gate/up, activation, down, residual), then the
/// merger. Windowed blocks cost as full ones (see the module docs); `attention` sets the score traffic.
pub fn encoder_ops(
    spec: &ModelSpec,
    inv: &Inventory,
    grid: &ImageGrid,
    attention: VisionAttention,
) -> Result<Vec<Op>, VisionError> {
    let v = spec.vision.as_ref().ok_or_else(|| VisionError::NoEncoder { model: spec.name.clone() })?;
    let n = grid.patches();
    let nf = n as f64;
    let w = v.width as f64;
    let matmul = |unit: UnitId, suffix: &str, tokens: u64| -> Option<Op> {
        let u = inv.unit(unit)?;
        let t = u.parts.iter().map(|p| &inv.tensors[p.tensor]).find(|t| t.name.ends_with(suffix))?;
        let (rows, cols) = (t.shape[0], t.shape[1]);
        Some(Op {
            kind: OpKind::MatMul { n: rows, k: cols },
            unit,
            tokens,
            dtype: t.dtype,
            flops: 2.0 * tokens as f64 * rows as f64 * cols as f64,
            weight_bytes: t.bytes as f64,
            act_bytes: ACT_BYTES * tokens as f64 * (rows + cols) as f64,
            kv_bytes: 0.0,
        })
    };
    let elementwise = |kind: OpKind, unit: UnitId, elems: f64, flops_per: f64| Op {
        kind,
        unit,
        tokens: n,
        dtype: DType::F32,
        flops: elems * flops_per,
        weight_bytes: 0.0,
        act_bytes: ACT_BYTES * 2.0 * elems,
        kv_bytes: 0.0,
    };
    let mut out = Vec::with_capacity(v.depth as usize * 12 + 5);
    out.extend(matmul(UnitId::VisionPatchEmbd, "patch_embd.weight", n));
    let heads = f64::from(v.n_heads);
    let head_dim = v.width / u64::from(v.n_heads);
    for b in 0..v.depth {
        let unit = UnitId::VisionBlock { block: b };
        let windowed = !v.full_attn_blocks.contains(&b);
        out.push(elementwise(OpKind::Norm, unit, nf * w, 3.0));
        out.extend(matmul(unit, "attn_qkv.weight", n));
        out.push(elementwise(OpKind::Rope, unit, 2.0 * nf * w, 6.0));
        let score_elems = heads * nf * nf;
        let mask_bytes = if !windowed {
            0.0
        } else if attention == VisionAttention::Flash {
            2.0 * nf * nf
        } else {
            4.0 * nf * nf
        };
        // Scores written, read and written by the softmax, read by P·V: four passes when materialised.
        let score_bytes =
            if attention == VisionAttention::Flash { 0.0 } else { 4.0 * ACT_BYTES * score_elems };
        out.push(Op {
            kind: OpKind::Attention {
                q_heads: v.n_heads,
                kv_heads: v.n_heads,
                head_dim,
                keys: n,
                scanned_keys: n,
                decode: false,
                materialized: attention != VisionAttention::Flash,
            },
            unit,
            tokens: n,
            dtype: DType::F16,
            flops: 4.0 * score_elems * head_dim as f64,
            weight_bytes: 0.0,
            act_bytes: ACT_BYTES * 4.0 * nf * w + score_bytes + mask_bytes,
            kv_bytes: 0.0,
        });
        out.extend(matmul(unit, "attn_out.weight", n));
        out.push(elementwise(OpKind::Add, unit, nf * w, 1.0));
        out.push(elementwise(OpKind::Norm, unit, nf * w, 3.0));
        out.extend(matmul(unit, "ffn_gate.weight", n));
        out.extend(matmul(unit, "ffn_up.weight", n));
        out.push(elementwise(OpKind::Activation, unit, nf * v.mlp as f64, 2.0));
        out.extend(matmul(unit, "ffn_down.weight", n));
        out.push(elementwise(OpKind::Add, unit, nf * w, 1.0));
    }
    let tokens = grid.tokens();
    out.push(elementwise(OpKind::Norm, UnitId::VisionMerger, nf * w, 3.0));
    out.extend(matmul(UnitId::VisionMerger, "mm.0.weight", tokens));
    out.push(elementwise(OpKind::Activation, UnitId::VisionMerger, nf * w, 2.0));
    out.extend(matmul(UnitId::VisionMerger, "mm.2.weight", tokens));
    Ok(out)
}

/// Kernel launches the attention of one block takes beyond the untiled path: the tiles' own ops (query
/// slice copy, scores, softmax, P·V, output copy, concat) for every tile after the first.
#[must_use]
pub fn extra_attention_launches(positions: u64, attention: VisionAttention) -> u64 {
    match attention {
        VisionAttention::TiledQ { q_tile } => 6 * (positions.div_ceil(q_tile.max(1)).saturating_sub(1)),
        VisionAttention::Materialised | VisionAttention::Flash => 0,
    }
}

/// Where the vision tower's weights live during the encode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionWeights {
    /// Resident in VRAM (stock llama.cpp).
    Pinned,
    /// In host memory, each block copied to the GPU just before its ops run (VLMOpt's `-vto-offload-cpu`: ggml's
    /// scheduler offloads the ops, so the weights cross PCIe per use); one block's weights are staged at a time.
    Streamed,
    /// In host memory and computed on the CPU.
    Cpu,
}

/// How the encoder's VRAM and the language model's meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Handover {
    /// The language model's VRAM is taken only after the encoder's is freed (VLMOpt): peak = max of the two.
    Serialised,
    /// Both are held at once (stock llama.cpp creates the LLM context before encoding): peak = their sum, the
    /// runtime overhead counted once.
    Overlapping,
}

impl Handover {
    /// Peak VRAM of a request whose encode peaks at `vision_bytes` and whose language phases peak at
    /// `language_bytes`, each including the runtime overhead `runtime_bytes` once.
    #[must_use]
    pub fn peak_bytes(self, vision_bytes: u64, language_bytes: u64, runtime_bytes: u64) -> u64 {
        match self {
            Handover::Serialised => vision_bytes.max(language_bytes),
            Handover::Overlapping => vision_bytes + language_bytes.saturating_sub(runtime_bytes),
        }
    }
}

/// The plan of one image's encode: grid, where the weights live, the attention kernel, and its VRAM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VisionPlan {
    pub grid: ImageGrid,
    pub weights: VisionWeights,
    pub attention: VisionAttention,
    /// Pinned weights, staged weights (as `streaming_slots_bytes`), compute buffer (scratch), runtime.
    pub vram: crate::plan::VramBreakdown,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;

    fn cr1() -> (ModelSpec, VisionConfig) {
        let spec = catalog::get("cosmos-reason1-7b").unwrap();
        let v = spec.vision.clone().unwrap();
        (spec, v)
    }

    #[test]
    fn the_papers_resolutions_give_the_known_grids() {
        let (_, v) = cr1();
        // 3840×2160 scaled to a longer side of 640/1280/1920/2560 px, aligned up to 28 px.
        let img = |max_side_px| SourceImage { width_px: 3840, height_px: 2160, max_side_px };
        for (side, w, h, tokens) in [
            (640, 644, 364, 299),
            (1280, 1288, 728, 1196),
            (1920, 1932, 1092, 2691),
            (2560, 2576, 1456, 4784),
        ] {
            let g = ImageGrid::fit(&v, img(side), false).unwrap();
            assert_eq!((g.width_px, g.height_px), (w, h), "side {side}");
            assert_eq!(g.tokens(), tokens, "side {side}");
            assert_eq!(g.patches(), 4 * tokens);
        }
        // Flash attention: sides aligned to 224 px, positions a multiple of 256.
        for (side, w, h) in [(640, 672, 448), (1280, 1344, 896), (1920, 2016, 1120), (2560, 2688, 1568)] {
            let g = ImageGrid::fit(&v, img(side), true).unwrap();
            assert_eq!((g.width_px, g.height_px), (w, h), "side {side}");
            assert_eq!(g.patches() % 256, 0);
        }
        // Never scaled up.
        let g = ImageGrid::fit(&v, SourceImage { width_px: 448, height_px: 448, max_side_px: 2560 }, false)
            .unwrap();
        assert_eq!((g.patches(), g.tokens()), (1024, 256));
    }

    #[test]
    fn bad_images_are_named() {
        let (_, v) = cr1();
        let img = |width_px, max_side_px| SourceImage { width_px, height_px: 100, max_side_px };
        let e = ImageGrid::fit(&v, img(0, 640), false).unwrap_err().to_string();
        assert!(e.contains("width_px") && e.contains('0'), "{e}");
        let e = ImageGrid::fit(&v, img(100, 1 << 20), false).unwrap_err().to_string();
        assert!(e.contains("max_side_px"), "{e}");
        let llm = catalog::get("nemo-8b").unwrap();
        let g = ImageGrid::fit(&v, img(640, 640), false).unwrap();
        let e = encoder_ops(&llm, &Inventory::new(&llm), &g, VisionAttention::Flash).unwrap_err();
        assert!(e.to_string().contains("nemo-8b"), "{e}");
    }

    #[test]
    fn materialised_scores_grow_quadratically_and_tiles_linearly() {
        let (_, v) = cr1();
        let scores = |n: u64, a| encoder_scratch_bytes(&v, n, a) as f64;
        // Doubling N: the materialised buffer ×≈4 (scores and mask dominate).
        let r = scores(20_000, VisionAttention::Materialised) / scores(10_000, VisionAttention::Materialised);
        assert!((3.8..=4.0).contains(&r), "{r}");
        // A fixed tile: its scores grow like N; the f32 mask (4 N²) remains and is all that stays quadratic.
        let tiled = |n| scores(n, VisionAttention::TiledQ { q_tile: 256 }) - 4.0 * (n * n) as f64;
        let r = tiled(20_000) / tiled(10_000);
        assert!((1.9..=2.1).contains(&r), "{r}");
        // Flash attention at 1440p is well below the materialised scores (23 GB).
        let n = 19_136;
        assert!(scores(n, VisionAttention::Flash) < 3.5e9);
        assert!(scores(n, VisionAttention::Materialised) > 23e9);
    }

    #[test]
    fn the_tile_keeps_one_tiles_scores_within_the_budget() {
        let (_, v) = cr1();
        for (n, budget) in [(4784u64, 3u64 << 30), (10_764, 7 << 30), (19_136, 1 << 30), (19_136, 13 << 30)] {
            let q = q_tile_for_budget(&v, n, budget);
            assert!(q.is_multiple_of(64) || q == n, "{q}");
            assert!((64..=n).contains(&q));
            // Rounding up to 64 may pass the budget by less than one 64-row step.
            assert!(4 * 16 * (q - 63.min(q)) * n <= budget, "n {n}: tile {q}");
            // ggml's 2 GiB limit on the mask rows of one tile.
            assert!(i32::try_from(q * n * 4).is_ok() || q == 64);
        }
        // A budget that holds every score gives one tile.
        assert_eq!(q_tile_for_budget(&v, 1196, 1 << 30), 1196);
    }

    #[test]
    fn serialised_handover_peaks_at_the_max_and_overlap_at_the_sum() {
        let gb = 1u64 << 30;
        assert_eq!(Handover::Serialised.peak_bytes(3 * gb, 7 * gb, gb / 2), 7 * gb);
        assert_eq!(Handover::Serialised.peak_bytes(9 * gb, 7 * gb, gb / 2), 9 * gb);
        // Runtime overhead held once.
        assert_eq!(Handover::Overlapping.peak_bytes(3 * gb, 7 * gb, gb / 2), 10 * gb - gb / 2);
    }

    #[test]
    fn encoder_ops_count_the_quadratic_attention() {
        let (spec, v) = cr1();
        let inv = Inventory::new(&spec);
        let g = ImageGrid::fit(&v, SourceImage { width_px: 3840, height_px: 2160, max_side_px: 1280 }, false)
            .unwrap();
        let ops = encoder_ops(&spec, &inv, &g, VisionAttention::Flash).unwrap();
        let attn: Vec<&Op> = ops.iter().filter(|o| matches!(o.kind, OpKind::Attention { .. })).collect();
        assert_eq!(attn.len(), 32);
        let n = g.patches() as f64;
        assert!((attn[0].flops - 4.0 * n * n * 1280.0).abs() < 1.0);
        // Every matmul weight of the tower is read once.
        let w: f64 = ops.iter().map(|o| o.weight_bytes).sum();
        let tower: u64 = inv.units.iter().filter(|u| u.id.is_vision()).map(|u| u.weight_bytes).sum();
        assert!(w <= tower as f64 && w > 0.95 * tower as f64, "{w} vs {tower}");
        let m = encoder_ops(&spec, &inv, &g, VisionAttention::Materialised).unwrap();
        let bytes = |ops: &[Op]| ops.iter().map(Op::bytes).sum::<f64>();
        assert!(bytes(&m) > bytes(&ops) + 32.0 * 16.0 * 16.0 * n * n * 0.99);
    }
}
