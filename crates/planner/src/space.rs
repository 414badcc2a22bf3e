//! The decision space `greedy`, `ilp` and `exhaustive` share, so that their results are comparable.
//!
//! Per phase, one decision per [`Group`]:
//! - **attention** of layer `l`: the attention block and (MoE) the router, which is tiny and runs right after
//!   it, and any shared experts, placed together; the layer's KV follows the side that runs attention (CPU
//!   with CPU attention, pinned or streamed with GPU attention);
//! - the dense **FFN** of a layer;
//! - the **output head** (with the token embedding when they are tied);
//! - and per MoE layer, integer **counts** of pinned, streamed and CPU routed experts.
//!
//! The token embedding of an untied model (a row gather) and the vision units (no text op reads them) stay on
//! the CPU. The pipeline depth is one of [`DEPTHS`].

use pipeshard_core::plan::Placement;

use crate::estimate::{Estimator, Layout, Structure};

/// Pipeline depths the searches consider. Under the estimator's model two slots already overlap every copy
/// with compute (the occupancy bound Σ(copy + compute)/2 never exceeds the larger of the copy and compute
/// bounds), so deeper rings would only cost VRAM; depth 1 saves a slot when streaming is light. Deeper rings
/// do help in the simulator (expert copies queue behind their router); [`crate::judge`] tries them.
pub const DEPTHS: [u32; 2] = [1, 2];

/// Units placed together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Weight units (inventory positions).
    pub units: Vec<usize>,
    /// The KV unit of an attention group.
    pub kv: Option<usize>,
}

/// One option for a group: where its weights go and, for attention, where the KV goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Choice {
    pub weights: Placement,
    /// Ignored for groups without KV; `Cpu` exactly when `weights` is `Cpu`.
    pub kv: Placement,
}

/// The options of an attention group.
pub const ATTN_CHOICES: [Choice; 5] = [
    Choice { weights: Placement::Cpu, kv: Placement::Cpu },
    Choice { weights: Placement::Pinned, kv: Placement::Pinned },
    Choice { weights: Placement::Pinned, kv: Placement::Streamed },
    Choice { weights: Placement::Streamed, kv: Placement::Pinned },
    Choice { weights: Placement::Streamed, kv: Placement::Streamed },
];

/// The options of any other group.
pub const PLAIN_CHOICES: [Choice; 3] = [
    Choice { weights: Placement::Cpu, kv: Placement::Cpu },
    Choice { weights: Placement::Pinned, kv: Placement::Cpu },
    Choice { weights: Placement::Streamed, kv: Placement::Cpu },
];

/// The groups of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Space {
    pub groups: Vec<Group>,
    /// Layers with routed experts.
    pub expert_layers: Vec<usize>,
}

impl Space {
    /// The groups of the structure.
    #[must_use]
    pub fn new(st: &Structure) -> Space {
        let mut groups = Vec::new();
        let mut expert_layers = Vec::new();
        for (l, lu) in st.layers.iter().enumerate() {
            let mut units = vec![lu.attn];
            units.extend(lu.router);
            units.extend(lu.shared_experts);
            groups.push(Group { units, kv: Some(lu.kv) });
            if let Some(f) = lu.ffn {
                groups.push(Group { units: vec![f], kv: None });
            }
            if !lu.experts.is_empty() {
                expert_layers.push(l);
            }
        }
        let mut out = vec![st.output];
        if st.tied_embeddings {
            out.push(st.token_embd);
        }
        groups.push(Group { units: out, kv: None });
        Space { groups, expert_layers }
    }

    /// The options of group `g`.
    #[must_use]
    pub fn choices(&self, g: usize) -> &'static [Choice] {
        if self.groups[g].kv.is_some() { &ATTN_CHOICES } else { &PLAIN_CHOICES }
    }

    /// Sets group `g` of `layout` to `choice`.
    pub fn apply(&self, layout: &mut Layout, g: usize, choice: Choice) {
        let group = &self.groups[g];
        for &u in &group.units {
            layout.placements[u] = choice.weights;
        }
        if let Some(kv) = group.kv {
            layout.placements[kv] = if choice.weights == Placement::Cpu { Placement::Cpu } else { choice.kv };
        }
    }

    /// Group `g`'s current choice in `layout`.
    #[must_use]
    pub fn choice_of(&self, layout: &Layout, g: usize) -> Choice {
        let group = &self.groups[g];
        Choice {
            weights: layout.placements[group.units[0]],
            kv: group.kv.map_or(Placement::Cpu, |kv| layout.placements[kv]),
        }
    }

    /// Weight bytes of group `g` (KV excluded).
    #[must_use]
    pub fn weight_bytes(&self, est: &Estimator, g: usize) -> u64 {
        self.groups[g].units.iter().map(|&u| est.unit_bytes[u]).sum()
    }
}
