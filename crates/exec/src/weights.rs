//! Model geometry and weights: every tensor of a decoder (dense, or Qwen3-MoE with routed experts),
//! random-initialised from a seed or loaded from an HF checkpoint ([`ModelWeights::from_checkpoint`]) or a
//! GGUF file ([`ModelWeights::from_gguf`]). An
//! expert's unit holds its slices of the merged `*_exps` tensors.
//!
//! [`Dims`] holds the architecture facts the kernels need and checks that the executor can run the spec.
//! [`ModelWeights::random`] fills one page-aligned host buffer per placement unit, with the unit's tensors laid
//! out back to back (16-byte aligned) in inventory order; a VRAM copy of a unit uses the same layout, so
//! streaming a unit is one copy. Values are uniform with a standard deviation of 1/√(fan-in) for matrices;
//! those that write into the residual stream (attention output, FFN and expert down) are scaled by
//! 1/√(2·layers), as GPT-2 initialises them, so the stream stays in range in f16 and bf16 and each token's own
//! embedding keeps dominating it. Unscaled, attention's averages over earlier tokens piled up a component
//! common to every token, and a MoE router's picks collapsed: qwen3-30b-a3b@24L's prefill of 1008 tokens
//! touched all 128 experts in layers 0–2 but 42–65 from layer 10 on, half the work a trained router's spread
//! gives (results/validation/2026-12-01-nvidia-h200, run24 cell 74). Norm weights are 1 ± 0.2 and biases
//! ± 0.1, so they matter. Each tensor's values depend only on (seed, tensor name, element index): the
//! same spec and seed give the same bytes whatever the thread count.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use pipeshard_core::checkpoint::{Checkpoint, hf_name};
use pipeshard_core::gguf::{GgufHeader, GgufValue};
use pipeshard_core::inventory::{Inventory, UnitId};
use pipeshard_core::model::{FfnKind, ModelSpec, NormKind};
use rayon::prelude::*;
use safetensors::Dtype;

use crate::error::{ExecError, Result};
use crate::hf;
use crate::host::{Elem, HostBuf};
use crate::quant::{QFormat, dequantize_gguf};

/// Alignment of tensors inside a unit (host and device): enough for vector loads and cuBLAS.
pub const TENSOR_ALIGN_BYTES: usize = 16;

/// The architecture facts the kernels need, checked for what the executor supports.
#[derive(Debug, Clone, PartialEq)]
pub struct Dims {
    /// Model name (for errors).
    pub model: String,
    /// Decoder layers.
    pub n_layers: usize,
    /// Residual width.
    pub hidden: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
    /// `n_heads × head_dim`.
    pub q_dim: usize,
    /// `n_kv_heads × head_dim`.
    pub kv_dim: usize,
    /// FFN intermediate size.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Dimensions of each head that RoPE rotates (even).
    pub rot_dims: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Norm epsilon.
    pub norm_eps: f32,
    /// RMSNorm or LayerNorm.
    pub norm: NormKind,
    /// SwiGLU or squared ReLU.
    pub ffn_kind: FfnKind,
    /// Per-head RMSNorm on q and k.
    pub qk_norm: bool,
    /// Bias on q, k, v.
    pub qkv_bias: bool,
    /// Element type of the activations fed to matmuls, and of every matrix unless `quant` is set.
    pub mat: Elem,
    /// The block format every matrix is stored in, when quantised (activations are then bf16).
    pub quant: Option<QFormat>,
    /// Routed experts of the MoE layers (`None` for a dense decoder).
    pub moe: Option<MoeDims>,
    /// Whether any layer has a dense FFN (false when every layer routes to experts, as in Qwen3-MoE).
    pub dense_ffn: bool,
}

/// The routed-expert geometry of a Qwen3-MoE-style decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeDims {
    /// Experts per MoE layer.
    pub n_experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Intermediate size of one expert.
    pub expert_ffn: usize,
    /// Whether the top-k routing weights are renormalised to sum to one (Qwen3-MoE `norm_topk_prob`).
    pub norm_topk_prob: bool,
}

impl Dims {
    /// Checks that `spec` is a dense text decoder with f16 or bf16 matrices and untied embeddings.
    pub fn new(spec: &ModelSpec) -> Result<Dims> {
        let t = &spec.text;
        let unsupported = |what: &str, hint: &str| ExecError::UnsupportedModel {
            model: spec.name.clone(),
            what: what.into(),
            hint: hint.into(),
        };
        if let Some(m) = &t.moe
            && m.n_shared_experts > 0
        {
            return Err(unsupported(
                &format!("{} shared experts", m.n_shared_experts),
                "routed experts only (Qwen3-MoE has none)",
            ));
        }
        if t.moe.is_some() && t.ffn_kind != FfnKind::SwiGlu {
            return Err(unsupported("MoE experts without SwiGLU", "experts are SwiGLU (Qwen3-MoE)"));
        }
        if t.hidden > crate::cuda::NORM_MAX_DIM as u64 {
            return Err(unsupported(
                &format!("a residual width of {}", t.hidden),
                &format!("the GPU norm kernel takes rows of up to {} elements", crate::cuda::NORM_MAX_DIM),
            ));
        }
        if spec.vision.is_some() {
            return Err(unsupported("a vision tower", "run the text decoder of a dense LLM"));
        }
        if t.tied_embeddings {
            return Err(unsupported("tied input/output embeddings", "use a model with an output head"));
        }
        let w = &spec.weights;
        let mats = [
            w.token_embd,
            w.output,
            w.attn_q,
            w.attn_k,
            w.attn_v,
            w.attn_output,
            w.ffn_gate,
            w.ffn_up,
            w.ffn_down,
        ];
        let moe_mats = [w.expert_gate_up, w.expert_down, w.router];
        let mat = mats[0];
        let moe_mixed = t.moe.is_some() && moe_mats.iter().any(|&d| d != mat);
        if moe_mixed || mats.iter().any(|&d| d != mat) || w.ffn_down_more_bits.is_some_and(|d| d != mat) {
            return Err(unsupported(
                "mixed matrix formats",
                "pass one of --weights bf16, f16, q8_0, q4_0, q2_k, q3_k, q4_k, q6_k",
            ));
        }
        let quant = QFormat::from_dtype(mat);
        let mat = match (Elem::from_dtype(mat), quant) {
            (Some(e @ (Elem::F16 | Elem::Bf16)), _) => e,
            (_, Some(_)) => Elem::Bf16,
            _ => {
                return Err(unsupported(
                    &format!("{mat} matrices"),
                    "pass --weights bf16, f16, q8_0, q4_0, q2_k, q3_k, q4_k or q6_k",
                ));
            }
        };
        if w.norms != pipeshard_core::dtype::DType::F32 {
            return Err(unsupported(&format!("{} norm weights", w.norms), "norms are stored in f32"));
        }
        if let Some(q) = quant {
            let block = q.block_elems() as u64;
            let expert_ffn = t.moe.as_ref().map_or(block, |m| m.expert_ffn);
            let q_dim = u64::from(t.n_heads) * t.head_dim;
            if let Some(bad) = [t.hidden, t.ffn, expert_ffn, q_dim].into_iter().find(|v| v % block != 0) {
                let hint = if block > 32 { "use --weights q8_0, q4_0 or bf16" } else { "use --weights bf16" };
                return Err(unsupported(
                    &format!("a matrix row of {bad} elements in {}", w.attn_q),
                    &format!("{} rows hold whole {block}-element blocks; {hint}", w.attn_q),
                ));
            }
        }
        let head_dim = t.head_dim as usize;
        if !head_dim.is_multiple_of(32) || head_dim > 256 {
            return Err(unsupported(
                &format!("head_dim {head_dim}"),
                "head_dim must be a multiple of 32, at most 256",
            ));
        }
        let mut rot_dims = ((head_dim as f64) * t.partial_rotary).round() as usize;
        rot_dims -= rot_dims % 2;
        Ok(Dims {
            model: spec.name.clone(),
            n_layers: t.n_layers as usize,
            hidden: t.hidden as usize,
            n_heads: t.n_heads as usize,
            n_kv_heads: t.n_kv_heads as usize,
            head_dim,
            q_dim: t.n_heads as usize * head_dim,
            kv_dim: t.n_kv_heads as usize * head_dim,
            ffn: t.ffn as usize,
            vocab: t.vocab as usize,
            rot_dims,
            rope_theta: t.rope_theta,
            norm_eps: t.norm_eps as f32,
            norm: t.norm,
            ffn_kind: t.ffn_kind,
            qk_norm: t.qk_norm,
            qkv_bias: t.qkv_bias,
            mat,
            quant,
            dense_ffn: (0..t.n_layers).any(|l| !spec.layer_is_moe(l)),
            moe: t.moe.as_ref().map(|m| MoeDims {
                n_experts: m.n_experts as usize,
                top_k: m.top_k as usize,
                expert_ffn: m.expert_ffn as usize,
                norm_topk_prob: m.norm_topk_prob,
            }),
        })
    }

    /// RoPE inverse frequencies (`rot_dims / 2` of them), computed as transformers does: in f32,
    /// `1 / theta^(2i / rot_dims)`.
    #[must_use]
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        (0..self.rot_dims / 2)
            .map(|i| 1.0 / (self.rope_theta as f32).powf((2 * i) as f32 / self.rot_dims as f32))
            .collect()
    }

    /// Bytes of a `[rows, cols]` matrix in the matrix format.
    #[must_use]
    pub fn mat_bytes(&self, rows: usize, cols: usize) -> usize {
        self.quant.map_or(rows * cols * self.mat.size_bytes(), |q| rows * q.row_bytes(cols))
    }

    /// Whether an expert's up starts where its gate ends, so that the two are one `[2·expert_ffn, hidden]`
    /// matrix ([`crate::cuda::Gpu::expert_ffn`] runs one matmul over it). The unit lays gate, up and down out
    /// in that order, each at a multiple of [`TENSOR_ALIGN_BYTES`]: they are adjacent unless the gate's bytes
    /// need padding. In a quantised format they never do (rows are whole blocks and `expert_ffn` is a
    /// multiple of the block, 32 or 256 elements, so the gate is a multiple of 32 blocks of an even byte
    /// count); in f16/bf16 they do where `expert_ffn × hidden` is not a multiple of 8. `false` for a dense
    /// model.
    #[must_use]
    pub fn expert_gate_up_adjacent(&self) -> bool {
        self.moe.is_some_and(|m| self.mat_bytes(m.expert_ffn, self.hidden).is_multiple_of(TENSOR_ALIGN_BYTES))
    }

    /// Row `row` of a matrix of `cols` columns whose bytes start `mat`, as f32 (dequantised exactly).
    #[must_use]
    pub fn mat_row(&self, mat: &[u8], row: usize, cols: usize) -> Vec<f32> {
        let mut out = vec![0f32; cols];
        self.mat_row_into(mat, row, &mut out);
        out
    }

    /// [`Self::mat_row`] into `out` (its length is the row's), without allocating.
    pub fn mat_row_into(&self, mat: &[u8], row: usize, out: &mut [f32]) {
        let rb = self.mat_bytes(1, out.len());
        let bytes = &mat[row * rb..(row + 1) * rb];
        match self.quant {
            Some(q) => q.dequantize_row(bytes, out),
            None => self.mat.read_row(bytes, out),
        }
    }

    /// `1/√head_dim`, the attention score scale.
    #[must_use]
    pub fn attn_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

/// One tensor inside a unit's buffer (for an expert: its slice of a merged `*_exps` tensor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSlot {
    /// GGUF-style name (`blk.3.attn_q.weight`, `blk.3.ffn_up_exps.weight` for an expert's slice).
    pub name: String,
    /// For an expert's slice: which expert of the merged tensor.
    pub expert: Option<usize>,
    /// Stored element type (for a quantised matrix: the activation type it computes with).
    pub elem: Elem,
    /// The block format of a quantised matrix.
    pub quant: Option<QFormat>,
    /// Shape, rows first (`[rows, row_elems]` for matrices and expert slices).
    pub shape: Vec<usize>,
    /// Byte offset inside the unit.
    pub offset: usize,
    /// Bytes.
    pub bytes: usize,
}

/// Offsets of the tensors an attention block reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttnOffsets {
    pub norm_w: usize,
    pub norm_b: Option<usize>,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub o: usize,
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
    pub q_bias: Option<usize>,
    pub k_bias: Option<usize>,
    pub v_bias: Option<usize>,
}

/// Offsets of the tensors an FFN block reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FfnOffsets {
    pub norm_w: usize,
    pub norm_b: Option<usize>,
    pub gate: Option<usize>,
    pub up: usize,
    pub down: usize,
}

/// Offsets of the output norm and head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutputOffsets {
    pub norm_w: usize,
    pub norm_b: Option<usize>,
    pub head: usize,
}

/// Offsets of an MoE layer's router unit: the FFN norm and the router matrix `[n_experts, hidden]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RouterOffsets {
    pub norm_w: usize,
    pub norm_b: Option<usize>,
    pub gate_inp: usize,
}

/// Offsets of one expert's slices: gate and up `[expert_ffn, hidden]`, down `[hidden, expert_ffn]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpertOffsets {
    pub gate: usize,
    pub up: usize,
    pub down: usize,
}

/// What a unit computes, with its tensors' offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitKind {
    /// The token embedding table at offset 0.
    Embd,
    /// An attention block.
    Attn(AttnOffsets),
    /// An FFN block.
    Ffn(FfnOffsets),
    /// The output norm and head.
    Output(OutputOffsets),
    /// An MoE layer's FFN norm and router (the engine runs the layer's whole MoE block at this unit).
    Router(RouterOffsets),
    /// One routed expert.
    Expert(ExpertOffsets),
}

/// One placement unit's tensors in one host buffer.
#[derive(Debug)]
pub struct UnitWeights {
    /// The unit.
    pub id: UnitId,
    /// What it computes.
    pub kind: UnitKind,
    /// Its tensors, in inventory order.
    pub tensors: Vec<TensorSlot>,
    /// Bytes of the laid-out unit (tensor bytes plus alignment padding).
    pub bytes: usize,
    /// The bytes.
    pub buf: HostBuf,
}

impl UnitWeights {
    /// Calls `f` with each tensor slot's bytes.
    fn fill_tensors(&mut self, mut f: impl FnMut(&mut [u8], &TensorSlot) -> Result<()>) -> Result<()> {
        let bytes = self.buf.as_mut_slice();
        self.tensors.iter().try_for_each(|t| f(&mut bytes[t.offset..t.offset + t.bytes], t))
    }

    /// The tensor whose name ends with `suffix`.
    #[must_use]
    pub fn tensor(&self, suffix: &str) -> Option<&TensorSlot> {
        self.tensors.iter().find(|t| t.name.ends_with(suffix))
    }

    /// Bytes of the tensor at `offset` with `len_bytes` bytes.
    #[must_use]
    pub fn bytes_at(&self, offset: usize, len_bytes: usize) -> &[u8] {
        &self.buf.as_slice()[offset..offset + len_bytes]
    }
}

/// Every weight of a decoder (dense or Qwen3-MoE), one host buffer per unit (one per expert).
#[derive(Debug)]
pub struct ModelWeights {
    /// The spec the weights follow.
    pub spec: ModelSpec,
    /// Its inventory.
    pub inventory: Inventory,
    /// Its geometry.
    pub dims: Dims,
    /// The seed the values come from (0 for [`ModelWeights::zeroed`] and [`ModelWeights::from_checkpoint`]).
    pub seed: u64,
    units: Vec<UnitWeights>,
    index: HashMap<UnitId, usize>,
}

/// splitmix64: a counter-based generator, so any element's value is computed independently.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of a name, to give each tensor its own stream.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Uniform value in [-1, 1) for element `i` of the stream `stream`.
fn uniform(stream: u64, i: u64) -> f32 {
    let bits = splitmix64(stream ^ splitmix64(i));
    ((bits >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// How a tensor's values are drawn: `center + half_width × U[-1, 1)`, in a model of `layers` decoder layers.
fn init_of(name: &str, shape: &[usize], layers: usize) -> (f32, f32) {
    let is_norm = name.contains("norm");
    if name.rsplit('.').next() == Some("bias") {
        (0.0, 0.1)
    } else if is_norm {
        (1.0, 0.2)
    } else if name.starts_with("token_embd") {
        (0.0, 1.0)
    } else {
        // Uniform on [-a, a] has std a/√3; std 1/√fan_in, over √(2·layers) for residual writers.
        let fan_in = *shape.last().expect("matrices have a row length") as f32;
        let writes_residual = name.contains(".attn_output.") || name.contains(".ffn_down");
        let depth = if writes_residual { (2.0 * layers.max(1) as f32).sqrt() } else { 1.0 };
        (0.0, 3f32.sqrt() / fan_in.sqrt() / depth)
    }
}

/// Fills `buf` with the rows of a quantised matrix `t` whose first element is `first_elem`: the f32 values
/// [`fill`] would draw, quantised row by row.
fn fill_quant(buf: &mut [u8], q: QFormat, seed: u64, t: &TensorSlot, layers: usize, first_elem: u64) {
    const ROWS: usize = 64;
    let (name, shape) = (&t.name, &t.shape);
    let stream = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ name_hash(name);
    let (center, half_width) = init_of(name, shape, layers);
    let k = *shape.last().expect("matrices have a row length");
    buf.par_chunks_mut(ROWS * q.row_bytes(k)).enumerate().for_each(|(c, chunk)| {
        let mut row = vec![0f32; k];
        for (r, out) in chunk.chunks_exact_mut(q.row_bytes(k)).enumerate() {
            let base = first_elem + ((c * ROWS + r) * k) as u64;
            for (j, v) in row.iter_mut().enumerate() {
                *v = center + half_width * uniform(stream, base + j as u64);
            }
            q.quantize_row(&row, out);
        }
    });
}

/// Fills `out` with tensor slot `t`'s values drawn from `seed`, in a model of `layers` decoder layers.
fn fill_random(out: &mut [u8], t: &TensorSlot, seed: u64, layers: usize) {
    let elems: usize = t.shape.iter().product();
    let first_elem = t.expert.map_or(0, |e| (e * elems) as u64);
    match t.quant {
        Some(q) => fill_quant(out, q, seed, t, layers, first_elem),
        None => fill(out, t.elem, seed, t, layers, first_elem),
    }
}

/// Fills `buf` with elements `first_elem..` of the tensor `t` (an expert's slice starts past the slices
/// before it, so the merged tensor is the same whichever way it is cut).
fn fill(buf: &mut [u8], elem: Elem, seed: u64, t: &TensorSlot, layers: usize, first_elem: u64) {
    const CHUNK: usize = 1 << 16;
    let stream = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ name_hash(&t.name);
    let (center, half_width) = init_of(&t.name, &t.shape, layers);
    let es = elem.size_bytes();
    buf.par_chunks_mut(CHUNK * es).enumerate().for_each(|(c, chunk)| {
        let base = first_elem + (c * CHUNK) as u64;
        match elem {
            Elem::Bf16 => {
                for (j, out) in chunk.chunks_exact_mut(2).enumerate() {
                    let v = center + half_width * uniform(stream, base + j as u64);
                    out.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
                }
            }
            Elem::F16 => {
                for (j, out) in chunk.chunks_exact_mut(2).enumerate() {
                    let v = center + half_width * uniform(stream, base + j as u64);
                    out.copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
            Elem::F32 => {
                for (j, out) in chunk.chunks_exact_mut(4).enumerate() {
                    let v = center + half_width * uniform(stream, base + j as u64);
                    out.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    });
}

fn unit_kind(id: UnitId, tensors: &[TensorSlot]) -> Result<UnitKind> {
    let find = |suffix: &str| tensors.iter().find(|t| t.name.ends_with(suffix)).map(|t| t.offset);
    let need = |suffix: &str| {
        find(suffix).ok_or_else(|| ExecError::UnsupportedModel {
            model: String::new(),
            what: format!("unit {id} without a `{suffix}` tensor"),
            hint: "the inventory of a dense decoder has it".into(),
        })
    };
    Ok(match id {
        UnitId::TokenEmbd => UnitKind::Embd,
        UnitId::Attn { .. } => UnitKind::Attn(AttnOffsets {
            norm_w: need("attn_norm.weight")?,
            norm_b: find("attn_norm.bias"),
            q: need("attn_q.weight")?,
            k: need("attn_k.weight")?,
            v: need("attn_v.weight")?,
            o: need("attn_output.weight")?,
            q_norm: find("attn_q_norm.weight"),
            k_norm: find("attn_k_norm.weight"),
            q_bias: find("attn_q.bias"),
            k_bias: find("attn_k.bias"),
            v_bias: find("attn_v.bias"),
        }),
        UnitId::Ffn { .. } => UnitKind::Ffn(FfnOffsets {
            norm_w: need("ffn_norm.weight")?,
            norm_b: find("ffn_norm.bias"),
            gate: find("ffn_gate.weight"),
            up: need("ffn_up.weight")?,
            down: need("ffn_down.weight")?,
        }),
        UnitId::Output => UnitKind::Output(OutputOffsets {
            norm_w: need("output_norm.weight")?,
            norm_b: find("output_norm.bias"),
            head: need("output.weight")?,
        }),
        UnitId::Router { .. } => UnitKind::Router(RouterOffsets {
            norm_w: need("ffn_norm.weight")?,
            norm_b: find("ffn_norm.bias"),
            gate_inp: need("ffn_gate_inp.weight")?,
        }),
        UnitId::Expert { .. } => UnitKind::Expert(ExpertOffsets {
            gate: need("ffn_gate_exps.weight")?,
            up: need("ffn_up_exps.weight")?,
            down: need("ffn_down_exps.weight")?,
        }),
        other => {
            return Err(ExecError::UnsupportedModel {
                model: String::new(),
                what: format!("unit {other}"),
                hint: "text decoders without shared experts only".into(),
            });
        }
    })
}

/// Where a tensor's values come from.
enum Values<'a> {
    /// Left zero.
    Zero,
    /// Drawn from a seed.
    Random(u64),
    /// Read from a checkpoint's safetensors files (each file opened once).
    Checkpoint(&'a Checkpoint, HashMap<PathBuf, File>),
    /// Read from a GGUF file's tensor data.
    Gguf(GgufSource<'a>),
}

/// A GGUF file (all its splits, each opened once) being read, and the tensors whose format was converted.
struct GgufSource<'a> {
    header: &'a GgufHeader,
    files: Vec<File>,
    /// llama.cpp stores a `llama` architecture's `attn_q`/`attn_k` rows in the order of ggml's interleaved
    /// RoPE (its converter permutes them); the executor rotates halves, as transformers does.
    rope_interleaved: bool,
    converted: Vec<String>,
}

impl Values<'_> {
    /// Fills one tensor's bytes.
    fn fill(&mut self, out: &mut [u8], t: &TensorSlot, dims: &Dims) -> Result<()> {
        match self {
            Values::Zero => Ok(()),
            Values::Random(seed) => {
                fill_random(out, t, *seed, dims.n_layers);
                Ok(())
            }
            Values::Checkpoint(ck, files) => read_tensor(ck, files, out, t, dims),
            Values::Gguf(src) => src.read(out, t, dims),
        }
    }
}

impl GgufSource<'_> {
    /// Reads our tensor `t` (an expert's slice of a merged `*_exps` tensor) into `out`: the file's bytes as
    /// they are where the formats match (quantised blocks stay quantised), else converted through f32
    /// (dequantised exactly, K-quants included, then rounded or quantised to `t`'s format) and noted in
    /// `converted`.
    fn read(&mut self, out: &mut [u8], t: &TensorSlot, dims: &Dims) -> Result<()> {
        let h = self.header;
        let file =
            |split: u32| h.files.get(split as usize).map_or_else(String::new, |f| f.display().to_string());
        let err = |split: u32, problem: String| ExecError::Checkpoint {
            file: file(split),
            tensor: t.name.clone(),
            problem,
        };
        let Some(info) = h.tensors.iter().find(|x| x.name == t.name) else {
            return Err(err(0, format!("is missing (the {} layout needs it)", dims.model)));
        };
        // GGUF dims run innermost first; an expert's slot leaves out the outermost (expert) dimension.
        let dims_outer_first: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        let slot_dims = &dims_outer_first[usize::from(t.expert.is_some())..];
        if slot_dims != t.shape.as_slice() {
            return Err(err(
                info.split,
                format!("has shape {dims_outer_first:?}, the {} layout expects {:?}", dims.model, t.shape),
            ));
        }
        let from = info.dtype.ok_or_else(|| err(info.split, format!("has ggml type {}", info.ggml_type)))?;
        let cols = *t.shape.last().expect("tensors have a row length");
        let rows = t.shape.iter().product::<usize>() / cols;
        let part_bytes =
            from.tensor_bytes(cols as u64, rows as u64).map_err(|e| err(info.split, e.to_string()))?;
        let at = h.data_starts[info.split as usize] + info.offset + t.expert.unwrap_or(0) as u64 * part_bytes;
        let mut raw = vec![0u8; part_bytes as usize];
        self.files[info.split as usize]
            .read_exact_at(&mut raw, at)
            .map_err(|e| err(info.split, format!("cannot be read at byte {at}: {e}")))?;
        let heads = if t.name.ends_with("attn_q.weight") {
            Some(dims.n_heads)
        } else if t.name.ends_with("attn_k.weight") {
            Some(dims.n_kv_heads)
        } else {
            None
        };
        if let (true, Some(heads)) = (self.rope_interleaved, heads) {
            raw = halves_from_interleaved(&raw, rows, heads);
        }
        let to = t.quant.map_or_else(|| t.elem.dtype(), QFormat::dtype);
        if from == to {
            out.copy_from_slice(&raw);
            return Ok(());
        }
        let vals: Vec<f32> = match (Elem::from_dtype(from), dequantize_gguf(from, &raw)) {
            (Some(e), _) => (0..raw.len() / e.size_bytes()).map(|i| e.read(&raw, i)).collect(),
            (None, Some(vals)) => vals,
            (None, None) => {
                return Err(err(
                    info.split,
                    format!(
                        "is {from}, which the executor cannot read (it reads f32, f16, bf16, q8_0, q4_0, q2_k, q3_k, \
                         q4_k and q6_k tensors); requantise the file to one of these"
                    ),
                ));
            }
        };
        match t.quant {
            Some(q) => out.copy_from_slice(&q.quantize(&vals, cols)),
            None => {
                for (i, &v) in vals.iter().enumerate() {
                    t.elem.write(out, i, v);
                }
            }
        }
        self.converted.push(format!("{} {from} → {to}", t.name));
        Ok(())
    }
}

/// `rows` rows of `heads` heads (equal byte lengths) reordered from ggml's interleaved RoPE pairs to halves:
/// within a head of `d` rows, row `2i + j` of the input is row `j·d/2 + i` of the output. Rows move whole, so
/// this works on quantised rows too.
#[must_use]
fn halves_from_interleaved(raw: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let (row_bytes, d) = (raw.len() / rows, rows / heads);
    let mut out = vec![0u8; raw.len()];
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let src = (h * d + 2 * i + j) * row_bytes;
                let dst = (h * d + j * d / 2 + i) * row_bytes;
                out[dst..dst + row_bytes].copy_from_slice(&raw[src..src + row_bytes]);
            }
        }
    }
    out
}

/// Reads our tensor `t` from the checkpoint into `out`, converting its dtype to `t.elem` (exact when widening,
/// round to nearest even when narrowing) and undoing the storage conventions of transformers ([`hf::norm_offset`]).
/// Bytes are read with positioned reads straight into the host buffer: one copy, no mapping of whole shards.
fn read_tensor(
    ck: &Checkpoint,
    files: &mut HashMap<PathBuf, File>,
    out: &mut [u8],
    t: &TensorSlot,
    dims: &Dims,
) -> Result<()> {
    let err = |file: &Path, problem: String| ExecError::Checkpoint {
        file: file.display().to_string(),
        tensor: hf_name(&t.name, None).unwrap_or_else(|| t.name.clone()),
        problem,
    };
    if t.expert.is_some() {
        return Err(ExecError::UnsupportedModel {
            model: dims.model.clone(),
            what: format!("routed experts from a checkpoint ({})", t.name),
            hint: "the checkpoint loader reads dense decoders; run MoE models with random weights (--seed)"
                .into(),
        });
    }
    let Some(ct) = ck.tensor(&t.name) else {
        return Err(err(&ck.config, format!("is missing (the {} layout needs {})", dims.model, t.name)));
    };
    let shape: Vec<usize> = ct.shape.iter().map(|&d| d as usize).collect();
    if shape != t.shape {
        return Err(err(
            &ct.file,
            format!("has shape {shape:?}, the {} layout expects {:?}", dims.model, t.shape),
        ));
    }
    let from = match ct.dtype {
        Dtype::F32 => Elem::F32,
        Dtype::F16 => Elem::F16,
        Dtype::BF16 => Elem::Bf16,
        other => {
            return Err(err(&ct.file, format!("is {other:?}; convert the checkpoint to bf16, f16 or f32")));
        }
    };
    let file = match files.entry(ct.file.clone()) {
        std::collections::hash_map::Entry::Occupied(f) => f.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            v.insert(File::open(&ct.file).map_err(|e| err(&ct.file, format!("cannot be read: {e}")))?)
        }
    };
    let read = |buf: &mut [u8]| {
        file.read_exact_at(buf, ct.file_offset).map_err(|e| err(&ct.file, format!("cannot be read: {e}")))
    };
    let offset = hf::norm_offset(dims, &t.name);
    if from == t.elem && offset == 0.0 && t.quant.is_none() {
        return read(out);
    }
    let mut raw = vec![0u8; ct.bytes as usize];
    read(&mut raw)?;
    if let Some(q) = t.quant {
        let vals: Vec<f32> =
            (0..raw.len() / from.size_bytes()).map(|i| from.read(&raw, i) + offset).collect();
        let k = *t.shape.last().expect("matrices have a row length");
        out.copy_from_slice(&q.quantize(&vals, k));
        return Ok(());
    }
    for i in 0..out.len() / t.elem.size_bytes() {
        t.elem.write(out, i, from.read(&raw, i) + offset);
    }
    Ok(())
}

impl ModelWeights {
    /// Random weights for `spec` from `seed`.
    pub fn random(spec: &ModelSpec, seed: u64) -> Result<ModelWeights> {
        Self::build(spec, &mut Values::Random(seed))
    }

    /// All-zero weights with the real layout (no values are drawn or touched): for layout and budget checks
    /// that need the executor's unit sizes but will not compute.
    pub fn zeroed(spec: &ModelSpec) -> Result<ModelWeights> {
        Self::build(spec, &mut Values::Zero)
    }

    /// The weights of an HF checkpoint ([`Checkpoint::open`]) laid out as `spec` stores them: every tensor of
    /// `spec`'s layout is read under its transformers name and converted to `spec`'s formats (bf16/f16 matrices,
    /// f32 norms). A tensor that is missing or has another shape is an error naming it.
    pub fn from_checkpoint(spec: &ModelSpec, checkpoint: &Checkpoint) -> Result<ModelWeights> {
        Self::build(spec, &mut Values::Checkpoint(checkpoint, HashMap::new()))
    }

    /// The weights of a GGUF file (`header` from [`pipeshard_core::gguf::read_header`], every split) laid out
    /// as `spec` stores them, and the tensors whose format had to be converted (`name from → to`). Each tensor
    /// is read with positioned reads straight into its unit's host buffer (the buffer the executor pins); a
    /// tensor in `spec`'s format is copied as it is, quantised blocks included. A tensor that is missing, has
    /// another shape or a format the executor cannot read is an error naming it and the file.
    pub fn from_gguf(spec: &ModelSpec, header: &GgufHeader) -> Result<(ModelWeights, Vec<String>)> {
        let files = header
            .files
            .iter()
            .map(|f| {
                File::open(f).map_err(|e| ExecError::Checkpoint {
                    file: f.display().to_string(),
                    tensor: String::new(),
                    problem: format!("cannot be opened: {e}"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let rope_interleaved =
            header.get("general.architecture").and_then(GgufValue::as_str).is_some_and(|a| a == "llama");
        let mut values = Values::Gguf(GgufSource { header, files, rope_interleaved, converted: Vec::new() });
        let w = Self::build(spec, &mut values)?;
        let Values::Gguf(src) = values else { unreachable!("built from a GGUF source") };
        Ok((w, src.converted))
    }

    fn build(spec: &ModelSpec, values: &mut Values<'_>) -> Result<ModelWeights> {
        let dims = Dims::new(spec)?;
        let inventory = Inventory::new(spec);
        let mut units = Vec::new();
        let mut index = HashMap::new();
        for unit in &inventory.units {
            if matches!(unit.id, UnitId::Kv { .. }) {
                continue;
            }
            let mut tensors = Vec::new();
            let mut offset = 0usize;
            for part in &unit.parts {
                let t = &inventory.tensors[part.tensor];
                let quant = QFormat::from_dtype(t.dtype);
                let elem = Elem::from_dtype(t.dtype).or(quant.map(|_| dims.mat)).ok_or_else(|| {
                    ExecError::UnsupportedModel {
                        model: spec.name.clone(),
                        what: format!("{} stored as {}", t.name, t.dtype),
                        hint: "pass --weights bf16, f16, q8_0, q4_0, q2_k, q3_k, q4_k or q6_k".into(),
                    }
                })?;
                let bytes = part.bytes as usize;
                // An expert's slice of `[n_experts, rows, row_elems]` is `[rows, row_elems]`.
                let shape =
                    t.shape[usize::from(part.expert.is_some())..].iter().map(|&s| s as usize).collect();
                tensors.push(TensorSlot {
                    name: t.name.clone(),
                    expert: part.expert.map(|e| e as usize),
                    elem,
                    quant,
                    shape,
                    offset,
                    bytes,
                });
                offset = (offset + bytes).next_multiple_of(TENSOR_ALIGN_BYTES);
            }
            let bytes = tensors.last().map_or(0, |t| t.offset + t.bytes);
            let kind = unit_kind(unit.id, &tensors).map_err(|e| match e {
                ExecError::UnsupportedModel { what, hint, .. } => {
                    ExecError::UnsupportedModel { model: spec.name.clone(), what, hint }
                }
                other => other,
            })?;
            let buf = HostBuf::try_zeroed(bytes, &format!("the weights of unit {}", unit.id))?;
            index.insert(unit.id, units.len());
            units.push(UnitWeights { id: unit.id, kind, tensors, bytes, buf });
        }
        match values {
            Values::Zero => {}
            // Drawn values depend only on (seed, tensor, element), so every unit fills at once, and only once
            // all buffers exist: allocating between fills serialised the page faults of the filling threads
            // (61 GB of qwen3-30b-a3b bf16 took 64-79 s on 16 threads at 4 threads' worth of CPU).
            Values::Random(seed) => {
                let (seed, layers) = (*seed, dims.n_layers);
                units.par_iter_mut().try_for_each(|u| {
                    u.fill_tensors(|out, t| {
                        fill_random(out, t, seed, layers);
                        Ok(())
                    })
                })?;
            }
            _ => {
                for u in &mut units {
                    u.fill_tensors(|out, t| values.fill(out, t, &dims))?;
                }
            }
        }
        let seed = if let Values::Random(seed) = values { *seed } else { 0 };
        Ok(ModelWeights { spec: spec.clone(), inventory, dims, seed, units, index })
    }

    /// The weights of a unit (none for KV units).
    #[must_use]
    pub fn unit(&self, id: UnitId) -> Option<&UnitWeights> {
        self.index.get(&id).map(|&i| &self.units[i])
    }

    /// Every weight unit, in inventory order.
    #[must_use]
    pub fn units(&self) -> &[UnitWeights] {
        &self.units
    }

    /// Bytes of every host buffer together.
    #[must_use]
    pub fn total_bytes(&self) -> u64 {
        self.units.iter().map(|u| u.bytes as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeshard_core::catalog;
    use pipeshard_core::dtype::DType;

    fn tiny() -> ModelSpec {
        crate::testing::tiny_spec()
    }

    /// Random MoE weights route as a trained, load-balanced router does, at every depth: 24 layers of 32
    /// experts, top 2, 24 tokens touch ≈ 25 experts a layer if picks are uniform. Unscaled residual writers
    /// made the tokens' hidden states converge with depth, so the deep layers' picks collapsed onto a few
    /// experts (≈ ⅓ of a 24-layer qwen3-30b-a3b's in prefill).
    #[test]
    fn random_moe_weights_keep_routing_spread_at_depth() {
        let mut spec = crate::testing::tiny_qwen3_moe_spec();
        spec.text.n_layers = 24;
        let moe = spec.text.moe.as_mut().unwrap();
        (moe.n_experts, moe.top_k, moe.expert_ffn) = (32, 2, 32);
        let w = ModelWeights::random(&spec, 3).unwrap();
        let tokens = crate::testing::random_tokens(24, 320, 5);
        let touched = crate::reference::touched_experts_f64(&w, &tokens);
        assert_eq!(touched.len(), 24);
        // Uniform picks: 32 · (1 − (1 − 2/32)^24) ≈ 25.2 distinct experts a layer.
        let deep = &touched[12..];
        let mean = deep.iter().sum::<usize>() as f64 / deep.len() as f64;
        assert!(mean > 21.0 && deep.iter().all(|&t| t >= 17), "distinct experts by layer: {touched:?}");
    }

    #[test]
    fn same_seed_same_bytes_and_sizes_match_inventory() {
        let spec = tiny();
        let a = ModelWeights::random(&spec, 7).unwrap();
        let b = ModelWeights::random(&spec, 7).unwrap();
        let c = ModelWeights::random(&spec, 8).unwrap();
        for ((ua, ub), uc) in a.units().iter().zip(b.units()).zip(c.units()) {
            assert_eq!(ua.buf.as_slice(), ub.buf.as_slice());
            assert_ne!(ua.buf.as_slice(), uc.buf.as_slice());
            assert_eq!(ua.bytes as u64, a.inventory.unit_bytes(ua.id), "{} has no padding", ua.id);
        }
    }

    #[test]
    fn values_have_the_intended_spread() {
        let w = ModelWeights::random(&tiny(), 1).unwrap();
        let u = w.unit(UnitId::Ffn { layer: 0 }).unwrap();
        let t = u.tensor("ffn_up.weight").unwrap();
        let n = t.bytes / 2;
        let vals: Vec<f32> = (0..n).map(|i| t.elem.read(u.bytes_at(t.offset, t.bytes), i)).collect();
        let mean = vals.iter().sum::<f32>() / n as f32;
        let var = vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n as f32;
        let expect = 1.0 / t.shape[1] as f32;
        assert!(mean.abs() < 0.02, "{mean}");
        assert!((var / expect - 1.0).abs() < 0.1, "var {var} vs {expect}");
        let norm = u.tensor("ffn_norm.weight").unwrap();
        let g = Elem::F32.read(u.bytes_at(norm.offset, norm.bytes), 3);
        assert!((0.8..=1.2).contains(&g));
    }

    #[test]
    fn quantised_weights_are_the_same_values_quantised() {
        for q in QFormat::ALL {
            let base = if q.block_elems() > 32 { crate::testing::tiny_k_spec() } else { tiny() };
            let bf = ModelWeights::random(&base, 3).unwrap();
            let spec = base.with_uniform_weights(q.dtype());
            let w = ModelWeights::random(&spec, 3).unwrap();
            assert_eq!((w.dims.quant, w.dims.mat), (Some(q), Elem::Bf16));
            let (u, ub) =
                (w.unit(UnitId::Ffn { layer: 1 }).unwrap(), bf.unit(UnitId::Ffn { layer: 1 }).unwrap());
            assert_eq!(u.bytes as u64, w.inventory.unit_bytes(u.id));
            let t = u.tensor("ffn_down.weight").unwrap();
            let tb = ub.tensor("ffn_down.weight").unwrap();
            assert_eq!(t.bytes, t.shape[0] * q.row_bytes(t.shape[1]));
            let (rows, k) = (t.shape[0], t.shape[1]);
            let m = u.bytes_at(t.offset, t.bytes);
            let mut worst = 0f32;
            for r in [0, rows / 2, rows - 1] {
                let deq = w.dims.mat_row(m, r, k);
                let want = bf.dims.mat_row(ub.bytes_at(tb.offset, tb.bytes), r, k);
                let amax = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in deq.iter().zip(&want) {
                    worst = worst.max((a - b).abs() / amax);
                }
            }
            // One quantisation step (1/8 of the block maximum for q4_0, 1/127 for q8_0, at most 2/15 of it for
            // q4_k's range, 1/32 for q6_k, 1/4 for q3_k, at most 2/3 for q2_k's range) plus bf16 rounding and,
            // for q2_k/q3_k, the loss of their 4- and 6-bit group scales.
            let bound = match q {
                QFormat::Q4_0 => 0.13,
                QFormat::Q8_0 => 0.012,
                QFormat::Q4K => 0.14,
                QFormat::Q6K => 0.035,
                QFormat::Q3K => 0.3,
                QFormat::Q2K => 0.75,
            };
            assert!(worst > 0.0 && worst < bound, "{q:?}: worst {worst}");
        }
    }

    /// `Dims::expert_gate_up_adjacent` says what the layout does: every expert's up starts where its gate
    /// ends in every format, unless f16/bf16 rows leave the gate's bytes off the tensor alignment, and then
    /// it does not.
    #[test]
    fn expert_gate_and_up_are_adjacent_as_dims_say() {
        let moe = crate::testing::tiny_qwen3_moe_spec();
        let moe_k = crate::testing::tiny_qwen3_moe_k_spec();
        // 33 × 130 bf16 elements: 8580 bytes, 4 past a multiple of 16.
        let mut padded = moe.clone().with_uniform_weights(DType::Bf16);
        padded.text.hidden = 130;
        padded.text.moe.as_mut().unwrap().expert_ffn = 33;
        let mut specs =
            vec![(moe.clone(), true), (moe.clone().with_uniform_weights(DType::Bf16), true), (padded, false)];
        for q in QFormat::ALL {
            let base = if q.block_elems() > 32 { &moe_k } else { &moe };
            specs.push((base.clone().with_uniform_weights(q.dtype()), true));
        }
        let mut checked = 0;
        for (spec, want) in specs {
            let w = ModelWeights::zeroed(&spec).unwrap();
            let (d, e) = (&w.dims, w.dims.moe.unwrap());
            assert_eq!(d.expert_gate_up_adjacent(), want, "{} in {:?}/{:?}", spec.name, d.mat, d.quant);
            for u in w.units() {
                let UnitKind::Expert(o) = u.kind else { continue };
                let adjacent = o.up == o.gate + d.mat_bytes(e.expert_ffn, d.hidden);
                assert_eq!(adjacent, want, "{} {}: {o:?}", spec.name, u.id);
                checked += 1;
            }
        }
        assert!(checked > 100, "{checked} experts checked");
        for d in [DType::Bf16, DType::Q4_0, DType::Q4K] {
            let spec = catalog::get("qwen3-30b-a3b").unwrap().with_uniform_weights(d);
            assert!(Dims::new(&spec).unwrap().expert_gate_up_adjacent(), "qwen3-30b-a3b in {d}");
        }
        assert!(!Dims::new(&tiny()).unwrap().expert_gate_up_adjacent(), "a dense model has no experts");
    }

    #[test]
    fn unsupported_models_are_named() {
        let mut moe =
            catalog::get("qwen3-30b-a3b").unwrap().truncated(1).unwrap().with_uniform_weights(DType::Bf16);
        assert_eq!(Dims::new(&moe).unwrap().moe.map(|m| (m.n_experts, m.top_k)), Some((128, 8)));
        moe.text.moe.as_mut().unwrap().n_shared_experts = 1;
        let e = Dims::new(&moe).unwrap_err();
        assert!(e.to_string().contains("shared experts"), "{e}");
        let q = catalog::get("qwen3-30b-a3b").unwrap();
        let mut dense = catalog::get("llama-3.1-8b").unwrap();
        dense.weights = q.weights.clone();
        let e = Dims::new(&dense).unwrap_err();
        assert!(e.to_string().contains("--weights bf16"), "{e}");
        let nemo4 = catalog::get("nemo-4b").unwrap();
        let d = Dims::new(&nemo4).unwrap();
        assert_eq!(d.rot_dims, 64);
        assert_eq!(d.norm, NormKind::LayerNorm);
    }
}
