//! A layer's weights as its forward sees them: the whole layer, or one leaf group at a time.
//!
//! The transformer block and the text encoder's decoder layer write their forward once, against a [`Layer`]:
//! before each sub-layer runs it takes the part that holds its weights ([`Layer::part`], a dotted path inside
//! the layer such as `"attention.to_q"`), uses it, and lets it go. A resident layer ([`Layer::Whole`]) hands out
//! itself for every part, so the resident forward is the same code with no cost. A layer under leaf-level group
//! offload ([`Layer::Leaves`]) hands out a guard of that one leaf group: only its weights are on the device, and
//! the group is released (and the next one already prefetched) when the guard drops. That is what makes leaf
//! level stream a leaf at a time, not a block at a time.
//!
//! The paths (given as `format_args!`, formatted only at leaf level) are the groups [`GroupOffload::leaves`](group_offload::GroupOffload::leaves) makes with
//! [`leaf_types`]: each linear layer is a group, and the norms travel with the struct that holds them (the root
//! group `""` for a block's sandwich norms, `"attention"` for the per-head query and key norms). A part the
//! forward forgets to take still works, loaded on touch and counted in `GroupStats::stray_loads`; the tests
//! assert there are none.

use std::ops::Deref;

use burn::module::Module;
use group_offload::{GroupGuard, LeafOffload, LeafPredicate};

use crate::error::Result;

/// The leaf predicate for this crate's models: burn's layers plus [`PtLinear`](crate::nn::PtLinear) and the text
/// encoder's `TokenEmbedding`.
pub fn leaf_types() -> LeafPredicate {
    LeafPredicate::default_layers().or_types(&["PtLinear", "TokenEmbedding"])
}

/// Where a layer's weights come from during one forward.
pub enum Layer<'a, M> {
    /// A layer whose weights are all where it runs (resident, or a block group taken whole).
    Whole(&'a M),
    /// A layer under leaf-level group offload: each part is taken from its leaf group when asked for.
    Leaves(&'a LeafOffload<M>),
}

impl<M> Clone for Layer<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M> Copy for Layer<'_, M> {}

impl<'a, M: Module> Layer<'a, M> {
    /// The part at `path` (`format_args!("")` for the layer's own norms): the whole layer, or a guard holding
    /// the leaf group at `path` on the device while it lives. The path is formatted only for a leaf-level layer,
    /// so the resident forward builds no strings.
    pub fn part(self, path: std::fmt::Arguments<'_>) -> Result<LayerPart<'a, M>> {
        match self {
            Layer::Whole(module) => Ok(LayerPart::Whole(module)),
            Layer::Leaves(leaves) => Ok(LayerPart::Leaf(leaves.group(&path.to_string())?)),
        }
    }

    /// The part at `path` when the layer has one there (the query and key norms are optional in some
    /// configurations); always the whole layer for [`Layer::Whole`].
    pub fn optional_part(self, path: std::fmt::Arguments<'_>) -> Result<Option<LayerPart<'a, M>>> {
        match self {
            Layer::Whole(module) => Ok(Some(LayerPart::Whole(module))),
            Layer::Leaves(leaves) => {
                let path = path.to_string();
                if leaves.group_paths().contains(&path.as_str()) {
                    Ok(Some(LayerPart::Leaf(leaves.group(&path)?)))
                } else {
                    Ok(None)
                }
            }
        }
    }
}

/// One part of a [`Layer`], dereferencing to the layer (only the part's weights are guaranteed on the device).
pub enum LayerPart<'a, M> {
    /// The whole layer.
    Whole(&'a M),
    /// A leaf group's guard.
    Leaf(GroupGuard<'a, M>),
}

impl<M> Deref for LayerPart<'_, M> {
    type Target = M;

    fn deref(&self) -> &M {
        match self {
            LayerPart::Whole(module) => module,
            LayerPart::Leaf(guard) => guard,
        }
    }
}

/// The value of a forward over a [`Layer::Whole`], which takes no group and so cannot fail.
pub(crate) fn whole<T>(result: Result<T>) -> T {
    match result {
        Ok(value) => value,
        // A whole layer hands out itself for every part; no path reaches an error.
        Err(error) => unreachable!("a resident layer took a group: {error}"),
    }
}
