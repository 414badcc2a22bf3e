//! A straightforward f64 forward pass over a whole token sequence: no rounding of activations, no KV cache
//! format, no SIMD, no tiling. It is the yardstick the executor's CPU and GPU paths are tested against (it
//! reads the same weights, upcast to f64). Only for small models: it recomputes everything per sequence.

use pipeshard_core::inventory::UnitId;
use pipeshard_core::model::{FfnKind, NormKind};

use crate::host::Elem;
use crate::weights::{Dims, ModelWeights, UnitKind, UnitWeights};

fn read_vec(u: &UnitWeights, off: usize, n: usize, elem: Elem) -> Vec<f64> {
    let bytes = &u.buf.as_slice()[off..];
    (0..n).map(|i| f64::from(elem.read(bytes, i))).collect()
}

/// A model matrix `[rows, cols]` at `off` times `x` (quantised matrices dequantised exactly).
fn matvec(d: &Dims, u: &UnitWeights, off: usize, rows: usize, cols: usize, x: &[f64]) -> Vec<f64> {
    let bytes = &u.buf.as_slice()[off..];
    (0..rows).map(|r| d.mat_row(bytes, r, cols).iter().zip(x).map(|(&w, x)| f64::from(w) * x).sum()).collect()
}

fn norm(kind: NormKind, x: &[f64], w: &[f64], b: Option<&[f64]>, eps: f64) -> Vec<f64> {
    let n = x.len() as f64;
    match kind {
        NormKind::RmsNorm => {
            let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / n + eps).sqrt();
            x.iter().zip(w).map(|(v, w)| v * inv * w).collect()
        }
        NormKind::LayerNorm => {
            let mean = x.iter().sum::<f64>() / n;
            let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
            let inv = 1.0 / (var + eps).sqrt();
            x.iter().enumerate().map(|(i, v)| (v - mean) * inv * w[i] + b.map_or(0.0, |b| b[i])).collect()
        }
    }
}

fn rope(x: &mut [f64], heads: usize, d: &Dims, pos: usize) {
    let half = d.rot_dims / 2;
    for i in 0..half {
        let inv = d.rope_theta.powf(-((2 * i) as f64) / d.rot_dims as f64);
        let (s, c) = (pos as f64 * inv).sin_cos();
        for h in 0..heads {
            let base = h * d.head_dim;
            let (a, b) = (x[base + i], x[base + i + half]);
            x[base + i] = a * c - b * s;
            x[base + i + half] = b * c + a * s;
        }
    }
}

fn swiglu(g: &[f64], u: &[f64]) -> Vec<f64> {
    g.iter().zip(u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect()
}

/// An MoE layer: `h += Σ_top-k w_e · expert_e(norm(h))`, routing by softmax over the router logits.
/// Adds the routed experts' outputs to `h`; returns how many distinct experts the tokens picked.
fn moe_layer(w: &ModelWeights, layer: u32, h: &mut [Vec<f64>]) -> usize {
    let d = &w.dims;
    let moe = d.moe.expect("a router unit implies MoE dims");
    let ru = w.unit(UnitId::Router { layer }).expect("router unit");
    let UnitKind::Router(r) = ru.kind else { unreachable!("router unit kind") };
    let nw = read_vec(ru, r.norm_w, d.hidden, Elem::F32);
    let nb = r.norm_b.map(|o| read_vec(ru, o, d.hidden, Elem::F32));
    let mut touched = vec![false; moe.n_experts];
    for x in h.iter_mut() {
        let xn = norm(d.norm, x, &nw, nb.as_deref(), f64::from(d.norm_eps));
        let logits = matvec(d, ru, r.gate_inp, moe.n_experts, d.hidden, &xn);
        let mx = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
        let sum: f64 = p.iter().sum();
        let mut order: Vec<usize> = (0..moe.n_experts).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let picked = &order[..moe.top_k];
        let total: f64 = picked.iter().map(|&e| p[e]).sum();
        for &e in picked {
            touched[e] = true;
            let eu = w.unit(UnitId::Expert { layer, expert: e as u32 }).expect("expert unit");
            let UnitKind::Expert(o) = eu.kind else { unreachable!("expert unit kind") };
            let g = matvec(d, eu, o.gate, moe.expert_ffn, d.hidden, &xn);
            let u = matvec(d, eu, o.up, moe.expert_ffn, d.hidden, &xn);
            let y = matvec(d, eu, o.down, d.hidden, moe.expert_ffn, &swiglu(&g, &u));
            let weight = if moe.norm_topk_prob { p[e] / total } else { p[e] / sum };
            x.iter_mut().zip(y).for_each(|(x, y)| *x += weight * y);
        }
    }
    touched.iter().filter(|&&t| t).count()
}

/// Logits (`vocab` values) after every position of `tokens`.
#[must_use]
pub fn logits_f64(w: &ModelWeights, tokens: &[u32]) -> Vec<Vec<f64>> {
    forward_f64(w, tokens).0
}

/// For a MoE model: how many distinct experts the tokens of `tokens` picked in each MoE layer.
#[must_use]
pub fn touched_experts_f64(w: &ModelWeights, tokens: &[u32]) -> Vec<usize> {
    forward_f64(w, tokens).1
}

/// Logits after every position, and the distinct experts picked in each MoE layer.
fn forward_f64(w: &ModelWeights, tokens: &[u32]) -> (Vec<Vec<f64>>, Vec<usize>) {
    let d = &w.dims;
    let mut touched = Vec::new();
    let n = tokens.len();
    let embd = w.unit(UnitId::TokenEmbd).expect("token embedding");
    let mut h: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| d.mat_row(embd.buf.as_slice(), t as usize, d.hidden).into_iter().map(f64::from).collect())
        .collect();
    for l in 0..d.n_layers {
        let au = w.unit(UnitId::Attn { layer: l as u32 }).expect("attention unit");
        let UnitKind::Attn(a) = au.kind else { unreachable!("attention unit kind") };
        let nw = read_vec(au, a.norm_w, d.hidden, Elem::F32);
        let nb = a.norm_b.map(|o| read_vec(au, o, d.hidden, Elem::F32));
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in h.iter().enumerate() {
            let xn = norm(d.norm, x, &nw, nb.as_deref(), f64::from(d.norm_eps));
            let mut q = matvec(d, au, a.q, d.q_dim, d.hidden, &xn);
            let mut k = matvec(d, au, a.k, d.kv_dim, d.hidden, &xn);
            let mut v = matvec(d, au, a.v, d.kv_dim, d.hidden, &xn);
            for (bias, x, dim) in
                [(a.q_bias, &mut q, d.q_dim), (a.k_bias, &mut k, d.kv_dim), (a.v_bias, &mut v, d.kv_dim)]
            {
                if let Some(o) = bias {
                    x.iter_mut().zip(read_vec(au, o, dim, Elem::F32)).for_each(|(x, b)| *x += b);
                }
            }
            for (nw, x) in [(a.q_norm, &mut q), (a.k_norm, &mut k)] {
                if let Some(o) = nw {
                    let w = read_vec(au, o, d.head_dim, Elem::F32);
                    let normed: Vec<f64> = x
                        .chunks(d.head_dim)
                        .flat_map(|hh| norm(NormKind::RmsNorm, hh, &w, None, f64::from(d.norm_eps)))
                        .collect();
                    *x = normed;
                }
            }
            rope(&mut q, d.n_heads, d, pos);
            rope(&mut k, d.n_kv_heads, d, pos);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        let scale = 1.0 / (d.head_dim as f64).sqrt();
        let group = d.n_heads / d.n_kv_heads;
        for t in 0..n {
            let mut att = vec![0f64; d.q_dim];
            for hh in 0..d.n_heads {
                let g = hh / group;
                let q = &qs[t][hh * d.head_dim..(hh + 1) * d.head_dim];
                let scores: Vec<f64> = (0..=t)
                    .map(|j| q.iter().zip(&ks[j][g * d.head_dim..]).map(|(a, b)| a * b).sum::<f64>() * scale)
                    .collect();
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, p) in e.iter().enumerate() {
                    for i in 0..d.head_dim {
                        att[hh * d.head_dim + i] += p / sum * vs[j][g * d.head_dim + i];
                    }
                }
            }
            let o = matvec(d, au, a.o, d.hidden, d.q_dim, &att);
            h[t].iter_mut().zip(o).for_each(|(x, o)| *x += o);
        }
        if w.unit(UnitId::Router { layer: l as u32 }).is_some() {
            touched.push(moe_layer(w, l as u32, &mut h));
            continue;
        }
        let fu = w.unit(UnitId::Ffn { layer: l as u32 }).expect("ffn unit");
        let UnitKind::Ffn(f) = fu.kind else { unreachable!("ffn unit kind") };
        let nw = read_vec(fu, f.norm_w, d.hidden, Elem::F32);
        let nb = f.norm_b.map(|o| read_vec(fu, o, d.hidden, Elem::F32));
        for x in &mut h {
            let xn = norm(d.norm, x, &nw, nb.as_deref(), f64::from(d.norm_eps));
            let up = matvec(d, fu, f.up, d.ffn, d.hidden, &xn);
            let act: Vec<f64> = match (d.ffn_kind, f.gate) {
                (FfnKind::SwiGlu, Some(g)) => swiglu(&matvec(d, fu, g, d.ffn, d.hidden, &xn), &up),
                _ => up.iter().map(|u| u.max(0.0) * u.max(0.0)).collect(),
            };
            let down = matvec(d, fu, f.down, d.hidden, d.ffn, &act);
            x.iter_mut().zip(down).for_each(|(x, o)| *x += o);
        }
    }
    let ou = w.unit(UnitId::Output).expect("output unit");
    let UnitKind::Output(o) = ou.kind else { unreachable!("output unit kind") };
    let nw = read_vec(ou, o.norm_w, d.hidden, Elem::F32);
    let nb = o.norm_b.map(|off| read_vec(ou, off, d.hidden, Elem::F32));
    let logits = h
        .iter()
        .map(|x| {
            let xn = norm(d.norm, x, &nw, nb.as_deref(), f64::from(d.norm_eps));
            matvec(d, ou, o.head, d.vocab, d.hidden, &xn)
        })
        .collect();
    (logits, touched)
}

/// ‖a − b‖ / ‖b‖.
#[must_use]
pub fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (f64::from(x) - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}
