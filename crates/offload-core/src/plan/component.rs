//! The plan's input and output vocabulary: a component described as plain data, the routes it can take, and the
//! host tiers its host copy can live in.

use std::fmt;

use crate::plan::error::PlanError;
use crate::size::format_size;

/// How a component's weights are split into blocks and leaves, for group offload.
///
/// Block bytes are in execution order; `outside_bytes` is everything not in a block (embedders, final layers),
/// which block and leaf offload keep resident. Leaves are the layers inside the blocks that leaf offload streams
/// one at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLayout {
    /// Bytes of each block, in the order the forward runs them.
    pub block_bytes: Vec<u64>,
    /// Bytes outside the blocks.
    pub outside_bytes: u64,
    /// The largest leaf layer inside the blocks (a linear weight, with its bias) in bytes.
    pub largest_leaf_bytes: u64,
    /// How many leaf groups the blocks hold: one per leaf layer, and one per block for the parameters under no
    /// leaf (its norms) where it has any.
    pub leaf_count: usize,
    /// The bytes of the first leaf group a forward takes (the first block's first part, in call order): with
    /// prefetch, the group the last call of an image prefetches for a next call that does not come in the
    /// phase. 0 when unknown.
    pub first_leaf_bytes: u64,
    /// Each leaf group's bytes, `leaf_count` of them, block by block (empty where unknown: the planner then takes
    /// the leaves as equal, the bytes in the blocks shared evenly). With them, a split of the streamed leaves over
    /// RAM, the file and further devices counts exactly the leaves a run keeps.
    pub leaf_bytes: Vec<u64>,
}

impl BlockLayout {
    /// `count` blocks of `bytes` each.
    pub fn uniform(count: usize, bytes: u64) -> Vec<u64> {
        vec![bytes; count]
    }

    /// The bytes in blocks.
    pub fn blocks_total(&self) -> u64 {
        self.block_bytes.iter().sum()
    }

    /// The bytes of the largest run of `per_group` consecutive blocks: the unit block offload uploads.
    pub fn largest_group(&self, per_group: usize) -> u64 {
        self.block_bytes.chunks(per_group.max(1)).map(|group| group.iter().sum::<u64>()).max().unwrap_or(0)
    }

    /// How many groups `per_group` blocks each make.
    pub fn group_count(&self, per_group: usize) -> usize {
        self.block_bytes.len().div_ceil(per_group.max(1))
    }
}

/// One component of a pipeline, as the planner sees it: sizes, structure, workload and cost.
///
/// Build it with [`ComponentSpec::new`] and the `with_*` methods; the planner validates it
/// ([`ComponentSpec::validate`]) once.
///
/// ```
/// use offload_core::plan::{BlockLayout, ComponentSpec};
/// let transformer = ComponentSpec::new("transformer", 12_309_817_472)
///     .with_layout(BlockLayout {
///         block_bytes: BlockLayout::uniform(32, 361_820_672).into_iter().chain([353_925_632; 2]).collect(),
///         outside_bytes: 23_704_704,
///         largest_leaf_bytes: 78_643_200,
///         leaf_count: 481,
///         first_leaf_bytes: 7_895_040,
///         leaf_bytes: Vec::new(),
///     })
///     .with_activation(547_608_576)
///     .with_cost(5.97e13, 8);
/// assert!(transformer.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ComponentSpec {
    /// The component's name (`transformer`, `text_encoder`).
    pub name: String,
    /// Weight bytes: what crosses the link when the component moves.
    pub weight_bytes: u64,
    /// What the weights take on the device, measured in the runtime's pages ([`crate::plan::Footprint`]): `None`
    /// where nothing was measured, and then the weight bytes are what the device holds (a simulated card). The
    /// planner counts what stays on the device in these bytes, a streamed part in the same proportion.
    pub device_bytes: Option<u64>,
    /// The block structure, when the component supports group offload; `None` when it does not (it can only be
    /// resident or component-offloaded).
    pub layout: Option<BlockLayout>,
    /// Peak activation bytes of one call for the workload (resolution, caption length, dtype).
    pub activation_bytes: u64,
    /// What one call at [`activation_bytes`](Self::activation_bytes) took on the device, measured in the runtime's
    /// pages ([`crate::plan::CallFootprint`]): `None` where nothing was measured. The planner counts a call as the
    /// larger of the two ([`call_on_device`](Self::call_on_device)): the estimate models the tensors, the pages
    /// add what a runtime takes beyond them for small ones.
    pub call_device_bytes: Option<u64>,
    /// Whether the weights are quantized. Quantized weights keep their own kernels and stream as they are (their
    /// groups move the quantized bytes), so they are routed as float weights of the same sizes are; the plan's
    /// explanation says they are quantized. The sizes (`weight_bytes`, the layout) are the quantized ones.
    pub quantized: bool,
    /// Whether the weights are in a file exactly as they are uploaded (a checkpoint of the dtype they run in,
    /// not quantized or LoRA-fused after loading), so the file itself can be their host copy
    /// ([`HostTier::File`]). `false` by default: a copy that differs from every file must live in RAM or in the
    /// disk store.
    pub file_backed: bool,
    /// FLOPs of one call, for the time prediction.
    pub flops_per_call: f64,
    /// Calls in one image: the denoising steps for the denoiser, 1 for an encoder or a decoder.
    pub calls_per_image: u32,
}

impl ComponentSpec {
    /// A component of `weight_bytes` with no block structure, no activations, no cost and one call per image.
    pub fn new(name: impl Into<String>, weight_bytes: u64) -> Self {
        Self {
            name: name.into(),
            weight_bytes,
            device_bytes: None,
            layout: None,
            activation_bytes: 0,
            call_device_bytes: None,
            quantized: false,
            file_backed: false,
            flops_per_call: 0.0,
            calls_per_image: 1,
        }
    }

    /// Declares the block structure, which makes the component group-offloadable.
    pub fn with_layout(mut self, layout: BlockLayout) -> Self {
        self.layout = Some(layout);
        self
    }

    /// Sets the activation estimate of one call.
    pub fn with_activation(mut self, bytes: u64) -> Self {
        self.activation_bytes = bytes;
        self
    }

    /// Sets the measured device bytes of the weights ([`ComponentSpec::device_bytes`]).
    pub fn with_device_bytes(mut self, bytes: u64) -> Self {
        self.device_bytes = Some(bytes);
        self
    }

    /// What the weights take on the device: the measured device bytes, else the weight bytes.
    pub fn device_weight(&self) -> u64 {
        self.device_bytes.unwrap_or(self.weight_bytes)
    }

    /// `weight` bytes of this component's weights on the device, in the measured footprint's proportion (the
    /// weight bytes themselves when nothing was measured); rounded up.
    pub fn on_device(&self, weight: u64) -> u64 {
        match self.device_bytes {
            Some(device) if self.weight_bytes > 0 => {
                let scaled = (u128::from(weight) * u128::from(device)).div_ceil(u128::from(self.weight_bytes));
                u64::try_from(scaled).unwrap_or(u64::MAX)
            }
            _ => weight,
        }
    }

    /// The weight bytes that take `device` bytes on the device, in the measured footprint's proportion (the
    /// inverse of [`on_device`](Self::on_device)); rounded down.
    pub fn from_device(&self, device: u64) -> u64 {
        match self.device_bytes {
            Some(footprint) if footprint > 0 => {
                let scaled = u128::from(device) * u128::from(self.weight_bytes) / u128::from(footprint);
                u64::try_from(scaled).unwrap_or(u64::MAX)
            }
            _ => device,
        }
    }

    /// What one call counts for on the device: the activation estimate, or the pages a call at that estimate
    /// took where that was measured and more ([`call_device_bytes`](Self::call_device_bytes)).
    pub fn call_on_device(&self) -> u64 {
        self.activation_bytes.max(self.call_device_bytes.unwrap_or(0))
    }

    /// Marks the weights quantized.
    pub fn quantized(mut self, quantized: bool) -> Self {
        self.quantized = quantized;
        self
    }

    /// Declares whether the weights are in a file exactly as they are uploaded ([`ComponentSpec::file_backed`]):
    /// true for a checkpoint loaded as it is, false once its weights are quantized or LoRA-fused after loading.
    pub fn with_file_backed(mut self, file_backed: bool) -> Self {
        self.file_backed = file_backed;
        self
    }

    /// Sets the FLOPs of one call and the calls per image.
    pub fn with_cost(mut self, flops_per_call: f64, calls_per_image: u32) -> Self {
        self.flops_per_call = flops_per_call;
        self.calls_per_image = calls_per_image;
        self
    }

    /// Whether block offload can stream this component (it has blocks; quantized or not).
    pub fn can_block_offload(&self) -> bool {
        self.layout.as_ref().is_some_and(|l| !l.block_bytes.is_empty())
    }

    /// Whether leaf offload can stream this component (it has leaves; quantized or not).
    pub fn can_leaf_offload(&self) -> bool {
        self.layout.as_ref().is_some_and(|l| l.leaf_count > 0)
    }

    /// Checks the description: a name, weights, block and outside bytes that add up to the weights, a leaf no
    /// larger than the weights, at least one call, a finite cost.
    pub fn validate(&self) -> Result<(), PlanError> {
        let invalid = |problem: String| PlanError::InvalidComponent { component: self.name.clone(), problem };
        if self.name.trim().is_empty() {
            return Err(invalid("the name is empty; name it as the pipeline does (\"transformer\")".into()));
        }
        if self.weight_bytes == 0 {
            return Err(invalid("it has no weight bytes; give the size of its weights".into()));
        }
        if self.device_bytes == Some(0) {
            return Err(invalid("its device bytes are 0; leave them unset when nothing was measured".into()));
        }
        if self.call_device_bytes == Some(0) {
            return Err(invalid("its call's device bytes are 0; leave them unset when nothing was measured".into()));
        }
        if self.calls_per_image == 0 {
            return Err(invalid("it is called 0 times per image; give at least 1 call".into()));
        }
        if !self.flops_per_call.is_finite() || self.flops_per_call < 0.0 {
            return Err(invalid(format!(
                "flops_per_call is {}; give a finite count, 0 when unknown",
                self.flops_per_call
            )));
        }
        if let Some(layout) = &self.layout {
            let in_blocks = layout.block_bytes.iter().try_fold(0u64, |sum, b| sum.checked_add(*b));
            let declared = in_blocks.and_then(|b| b.checked_add(layout.outside_bytes));
            if declared != Some(self.weight_bytes) {
                return Err(invalid(format!(
                    "its blocks ({} in {} blocks) and the bytes outside them ({}) do not add up to its weights ({}); \
                     count everything outside the blocks as outside_bytes",
                    in_blocks.map_or_else(|| "more than 16 EiB".to_string(), format_size),
                    layout.block_bytes.len(),
                    format_size(layout.outside_bytes),
                    format_size(self.weight_bytes)
                )));
            }
            if layout.largest_leaf_bytes > self.weight_bytes {
                return Err(invalid("its largest leaf is larger than its weights; give one layer's bytes".into()));
            }
            if !layout.leaf_bytes.is_empty() && layout.leaf_bytes.len() != layout.leaf_count {
                return Err(invalid(format!(
                    "its layout lists {} leaf sizes for {} leaves; give one size per leaf group, or none",
                    layout.leaf_bytes.len(),
                    layout.leaf_count
                )));
            }
            if layout.leaf_count == 0 && layout.block_bytes.is_empty() {
                return Err(invalid("its layout has neither blocks nor leaves; leave the layout out instead".into()));
            }
        }
        Ok(())
    }
}

/// Where a component's weights go while the pipeline runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// Kept on the device for the life of the process.
    Resident,
    /// Moved onto the device whole when it runs, offloaded when another component needs the room
    /// ([`ComponentsManager`](crate::ComponentsManager) auto offload).
    ComponentOffload,
    /// Streamed through the device in groups of consecutive blocks, the bytes outside the blocks resident.
    BlockGroupOffload {
        /// Blocks in one group: the unit of upload, prefetch and release.
        blocks_per_group: usize,
        /// Whether the next groups are uploaded on a worker thread while the current one computes.
        prefetch: bool,
        /// How many groups ahead are uploaded.
        depth: usize,
    },
    /// Streamed through the device one leaf layer at a time.
    LeafGroupOffload {
        /// Whether the next leaves are uploaded on a worker thread while the current one computes.
        prefetch: bool,
    },
    /// Not managed: the caller places the component itself. The plan predicts it as resident.
    Off,
}

impl Route {
    /// A short name for tables: `resident`, `component`, `block`, `leaf`, `off`.
    pub fn kind(&self) -> &'static str {
        match self {
            Route::Resident => "resident",
            Route::ComponentOffload => "component",
            Route::BlockGroupOffload { .. } => "block",
            Route::LeafGroupOffload { .. } => "leaf",
            Route::Off => "off",
        }
    }

    /// Whether the route streams groups (block or leaf offload).
    pub fn is_group_offload(&self) -> bool {
        matches!(self, Route::BlockGroupOffload { .. } | Route::LeafGroupOffload { .. })
    }
}

impl fmt::Display for Route {
    /// `resident`, `component offload`, `block x1, prefetch 1`, `block x2, no prefetch`, `leaf, prefetch`,
    /// `off`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Route::Resident => "resident".to_string(),
            Route::ComponentOffload => "component offload".to_string(),
            Route::BlockGroupOffload { blocks_per_group, prefetch: true, depth } => {
                format!("block x{blocks_per_group}, prefetch {depth}")
            }
            Route::BlockGroupOffload { blocks_per_group, prefetch: false, .. } => {
                format!("block x{blocks_per_group}, no prefetch")
            }
            Route::LeafGroupOffload { prefetch: true } => "leaf, prefetch".to_string(),
            Route::LeafGroupOffload { prefetch: false } => "leaf, no prefetch".to_string(),
            Route::Off => "off".to_string(),
        };
        f.pad(&text)
    }
}

/// Where a component's host copy lives: the tier its uploads read from.
///
/// The planner chooses one per component from the host budget ([`crate::plan::Plan`] explains each choice):
/// RAM where the copies fit (fastest), else the checkpoint file for a file-backed component, else the disk store
/// for a streamed one whose copy differs from the file. A resident component's tier says where it is loaded
/// from: one loaded from its file keeps no host copy; one loaded into RAM keeps its copy there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HostTier {
    /// Pageable RAM (anonymous memory), of which the plan's `pinned_bytes` are page-locked.
    #[default]
    Ram,
    /// The checkpoint file itself: no anonymous RAM; each upload reads its bytes from the file (through the page
    /// cache, which is then the RAM tier). Only for a [`ComponentSpec::file_backed`] component.
    File,
    /// The disk store (the `disk_store_dir` setting): files the mechanism writes once, for a streamed copy that
    /// differs from the checkpoint file (quantized or LoRA-fused weights); each upload reads from them.
    DiskStore,
}

impl HostTier {
    /// The tier's name in tables: `ram`, `file`, `disk store`.
    pub fn name(self) -> &'static str {
        match self {
            HostTier::Ram => "ram",
            HostTier::File => "file",
            HostTier::DiskStore => "disk store",
        }
    }

    /// Whether uploads from this tier read a disk (the checkpoint file or the disk store) rather than RAM.
    pub fn reads_disk(self) -> bool {
        matches!(self, HostTier::File | HostTier::DiskStore)
    }
}

impl fmt::Display for HostTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}
