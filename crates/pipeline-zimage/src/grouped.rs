//! The pipeline's components under group offload: the transformer's refiner and main blocks, and the text
//! encoder's decoder layers, stream through the device one group at a time, prefetched in the captured call
//! order.
//!
//! Two levels, as in diffusers ([`GroupLevel`]):
//!
//! - **Block level**: runs of `blocks_per_group` consecutive layers form a group; the layers outside the blocks
//!   (the transformer's embedders, final layer and pad tokens, about 23 MiB at the real size; the text encoder's
//!   token embedding, 742 MiB) stay resident, or stream as one group when [`GroupOptions::keep_outside`] is off.
//! - **Leaf level**: every linear layer of every block is a group, and the block's norms are one more
//!   ([`crate::layer`]); each layer's forward takes one leaf at a time, so the device holds the layers outside
//!   the blocks, the running leaf, the prefetched one and the norms.
//!
//! Both are [`GroupedModel`]s: registered with the manager as group-offloaded components, their resident bytes
//! counting in the strategy's view, and released whole between phases when `releasable`.

use std::path::PathBuf;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{Bool, Device, Int, Tensor};
use group_offload::run_call;
use group_offload::{
    BlockOffload, GroupOffload, GroupOffloadConfig, GroupOffloadedModel, LeafOffload, ModuleOffload, Residency,
};
use offload_core::{ComponentError, DeviceLedger, DeviceName, Offloadable};

use crate::error::{Error, Result};
use crate::layer::{Layer, leaf_types};
use crate::text_encoder::{DecoderLayer, TextEncoder, decoder_layer_forward, encode_valid_rows};
use crate::transformer::{ZImageBlock, ZImageState, ZImageTransformer2DModel, block_layer_forward, forward_each};

/// How a component's layers are cut into groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupLevel {
    /// Runs of consecutive layers (blocks) form a group.
    Block {
        /// Consecutive blocks uploaded as one group (at least 1).
        blocks_per_group: usize,
    },
    /// Every linear layer of every block is a group, and each block's norms one more.
    Leaf,
}

/// How [`ZImagePipeline::enable_group_offload_with`](crate::pipeline::ZImagePipeline::enable_group_offload_with)
/// streams a component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupOptions {
    /// Block or leaf level.
    pub level: GroupLevel,
    /// Whether the next groups are uploaded on the prefetch worker thread while the current one computes.
    pub prefetch: bool,
    /// Groups uploaded ahead of the running one when `prefetch` is on (at least 1).
    pub prefetch_depth: usize,
    /// Bytes of released groups that stay on the device (group offload's resident budget), beside the layers
    /// outside the blocks when those are kept.
    pub resident_budget: u64,
    /// Bytes of the streamed groups' host copies to pin (group offload's pinned budget: page-locked on CUDA,
    /// uploads charged as pinned copies).
    pub pinned_budget: u64,
    /// Keep the groups' host copies as files in this directory instead of in host memory.
    pub disk_store: Option<PathBuf>,
    /// Whether the manager may release the component whole (every group, the resident ones included) when
    /// another component comes onto the device. Phase-staged plans set it, so the next phase gets the memory
    /// this component's resident groups held; with `false` the manager never evicts it (group offload's default).
    pub releasable: bool,
    /// Whether the layers outside the blocks stay on the device (the default, at either level) or stream as one
    /// group like the blocks (the planner's full-pin rule).
    pub keep_outside: bool,
}

impl Default for GroupOptions {
    /// Block level with one block per group, prefetch depth 1, no resident or pinned budget, host memory store,
    /// never released whole, layers outside the blocks resident.
    fn default() -> Self {
        Self {
            level: GroupLevel::Block { blocks_per_group: 1 },
            prefetch: true,
            prefetch_depth: 1,
            resident_budget: 0,
            pinned_budget: 0,
            disk_store: None,
            releasable: false,
            keep_outside: true,
        }
    }
}

impl GroupOptions {
    /// Leaf level: prefetch depth 1, no resident budget, the layers outside the blocks resident, host memory
    /// store, never released whole.
    pub fn leaf() -> Self {
        Self { level: GroupLevel::Leaf, ..Self::default() }
    }

    /// Checks what a caller can get wrong, before anything is taken apart.
    pub fn validate(&self) -> Result<()> {
        if self.level == (GroupLevel::Block { blocks_per_group: 0 }) {
            return Err(Error::InvalidArgument {
                name: "blocks_per_group",
                reason: "it is 0; group at least 1 block".into(),
            });
        }
        if self.prefetch && self.prefetch_depth == 0 {
            return Err(Error::InvalidArgument {
                name: "prefetch_depth",
                reason: "it is 0 with prefetch on; use 1 or more, or turn prefetch off".into(),
            });
        }
        Ok(())
    }

    /// `config` (device, ledger, readings, record) with these options' prefetch, budgets and disk store.
    pub fn configure(&self, config: GroupOffloadConfig) -> GroupOffloadConfig {
        let config = config
            .with_prefetch(self.prefetch)
            .with_prefetch_depth(self.prefetch_depth.max(1))
            .with_resident_budget(self.resident_budget)
            .with_pinned_budget(self.pinned_budget);
        match &self.disk_store {
            Some(dir) => config.with_disk_store(dir.clone()),
            None => config,
        }
    }

    /// Checks the options and starts the offloader they configure on `config`.
    fn offloader(&self, config: GroupOffloadConfig) -> Result<GroupOffload> {
        self.validate()?;
        Ok(GroupOffload::new(self.configure(config))?)
    }

    /// Where the layers outside the blocks live: resident when kept, streamed as one group otherwise.
    fn outside(&self) -> Residency {
        if self.keep_outside { Residency::Resident } else { Residency::Streamed }
    }
}

/// A list of layers under group offload at either level.
pub enum Streamed<M> {
    /// Block level: groups of consecutive layers.
    Blocks(BlockOffload<M>),
    /// Leaf level: one leaf-level part per layer, named `{name}.{i}`.
    Leaves(Vec<LeafOffload<M>>),
}

impl<M> std::fmt::Debug for Streamed<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Streamed::Blocks(blocks) => f.debug_tuple("Blocks").field(blocks).finish(),
            Streamed::Leaves(layers) => f.debug_tuple("Leaves").field(&layers.len()).finish(),
        }
    }
}

impl<M: Module> Streamed<M> {
    /// Moves `layers` into `offload` at `level`, as the part `name` (block level) or the parts `{name}.{i}`
    /// (leaf level, one per layer, cut by [`leaf_types`]).
    pub fn new(offload: &GroupOffload, name: &str, layers: Vec<M>, level: GroupLevel) -> Result<Self> {
        Ok(match level {
            GroupLevel::Block { blocks_per_group } => {
                Streamed::Blocks(offload.blocks(name, layers, blocks_per_group)?)
            }
            GroupLevel::Leaf => {
                let leaves = leaf_types();
                let parts = layers
                    .into_iter()
                    .enumerate()
                    .map(|(i, layer)| offload.leaves(&format!("{name}.{i}"), layer, &leaves))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                Streamed::Leaves(parts)
            }
        })
    }

    /// Runs `step` over every layer in order, threading `state` through: each block group is taken whole, each
    /// leaf-level layer hands out its parts one at a time.
    pub fn fold<T>(&self, mut state: T, mut step: impl FnMut(Layer<'_, M>, T) -> Result<T>) -> Result<T> {
        match self {
            Streamed::Blocks(blocks) => {
                for group in blocks.iter() {
                    let group = group?;
                    for layer in group.iter() {
                        state = step(Layer::Whole(layer), state)?;
                    }
                }
            }
            Streamed::Leaves(layers) => {
                for layer in layers {
                    state = step(Layer::Leaves(layer), state)?;
                }
            }
        }
        Ok(state)
    }
}

/// A component taken apart for group offload: its parts `P`, the offloader that streams them, the ledger its
/// activations are charged to. Registered with the manager as group-offloaded (never evicted wholesale) unless
/// `releasable`.
pub struct GroupedModel<P> {
    model: GroupOffloadedModel,
    parts: P,
    ledger: Arc<dyn DeviceLedger>,
    exec: Device,
    class: &'static str,
    releasable: bool,
}

impl<P> std::fmt::Debug for GroupedModel<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupedModel")
            .field("class", &self.class)
            .field("groups", &self.model.offload().groups().len())
            .field("releasable", &self.releasable)
            .finish()
    }
}

impl<P> GroupedModel<P> {
    fn assemble(
        offload: GroupOffload,
        parts: P,
        ledger: Arc<dyn DeviceLedger>,
        class: &'static str,
        releasable: bool,
    ) -> Self {
        let exec = offload.config().device.clone();
        Self { model: GroupOffloadedModel::new(offload), parts, ledger, exec, class, releasable }
    }

    /// The offloader, for its statistics and call order.
    pub fn offload(&self) -> &GroupOffload {
        self.model.offload()
    }

    /// Runs `f` with `activation_bytes` accounted on the ledger, as [`crate::offload::BurnComponent::run`] does
    /// ([`group_offload::run_call`]: the call succeeds only once the device has done its work).
    pub fn run<R: group_offload::DeviceOutput>(
        &mut self,
        activation_bytes: u64,
        f: impl FnOnce(&Self, &Device) -> Result<R>,
    ) -> std::result::Result<R, ComponentError> {
        let config = self.model.offload().config();
        let (name, memory) = (config.device_name.clone(), config.memory.clone());
        let this = &*self;
        run_call(&self.exec, &name, self.ledger.as_ref(), memory.as_deref(), activation_bytes, || {
            f(this, &this.exec).map_err(crate::error::into_component_error)
        })
    }
}

impl<P: Send + 'static> Offloadable for GroupedModel<P> {
    fn bytes(&self) -> u64 {
        self.model.bytes()
    }

    fn device(&self) -> DeviceName {
        self.model.device()
    }

    fn onload(&mut self, device: &DeviceName) -> std::result::Result<(), ComponentError> {
        self.model.onload(device)
    }

    fn offload(&mut self) -> std::result::Result<(), ComponentError> {
        Offloadable::offload(&mut self.model)
    }

    fn resident_bytes(&self) -> u64 {
        self.model.resident_bytes()
    }

    fn evictable(&self) -> bool {
        self.releasable
    }

    fn class_name(&self) -> String {
        format!("{} (group offload)", self.class)
    }
}

/// The transformer's parts: the layers outside the blocks (`shell`) and its three block lists.
pub struct TransformerParts {
    shell: ModuleOffload<ZImageTransformer2DModel>,
    noise_refiner: Streamed<ZImageBlock>,
    context_refiner: Streamed<ZImageBlock>,
    layers: Streamed<ZImageBlock>,
}

/// A `ZImageTransformer2DModel` under group offload.
pub type GroupedTransformer = GroupedModel<TransformerParts>;

impl GroupedTransformer {
    /// Takes `transformer` apart under `config` (its device, ledger, readings and record) with `options` (level,
    /// prefetch, budgets, disk store: [`GroupOptions::configure`]); `ledger` is charged each forward's
    /// activations.
    pub fn new(
        mut transformer: ZImageTransformer2DModel,
        config: GroupOffloadConfig,
        options: &GroupOptions,
        ledger: Arc<dyn DeviceLedger>,
    ) -> Result<Self> {
        let offload = options.offloader(config)?;
        let level = options.level;
        let noise_refiner =
            Streamed::new(&offload, "noise_refiner", std::mem::take(&mut transformer.noise_refiner), level)?;
        let context_refiner =
            Streamed::new(&offload, "context_refiner", std::mem::take(&mut transformer.context_refiner), level)?;
        let layers = Streamed::new(&offload, "layers", std::mem::take(&mut transformer.layers), level)?;
        let shell = offload.module("shell", transformer, options.outside())?;
        let parts = TransformerParts { shell, noise_refiner, context_refiner, layers };
        Ok(Self::assemble(offload, parts, ledger, "ZImageTransformer2DModel", options.releasable))
    }

    /// The transformer's forward over items of possibly different sizes, one at a time (as
    /// [`ZImageTransformer2DModel::forward_items`]): `xs[i]` `[C, F, H, W]`, `t` `[n]`, `caps[i]` `[L_i, D_cap]`.
    pub fn forward_items(&self, xs: Vec<Tensor<4>>, t: Tensor<1>, caps: Vec<Tensor<2>>) -> Result<Vec<Tensor<4>>> {
        forward_each(xs, t, caps, |x, t, cap| self.forward(x, t, cap))
    }

    /// One forward: `x` `[B, C, F, H, W]`, `t` `[B]`, `cap_feats` `[B, L, D_cap]` → `[B, C, F, H, W]`.
    pub fn forward(&self, x: Tensor<5>, t: Tensor<1>, cap_feats: Tensor<3>) -> Result<Tensor<5>> {
        self.offload().ensure_device(&x.device())?;
        let parts = &self.parts;
        let mut embedded = parts.shell.get()?.embed(x, t, cap_feats);
        let (rope, adaln) = (embedded.image_rope.clone(), embedded.adaln.clone());
        embedded.image = parts
            .noise_refiner
            .fold(embedded.image, |block, image| block_layer_forward(block, image, &rope, Some(&adaln)))?;
        let rope = embedded.caption_rope.clone();
        embedded.caption = parts
            .context_refiner
            .fold(embedded.caption, |block, caption| block_layer_forward(block, caption, &rope, None))?;
        let ZImageState { hidden, rope, adaln, layout } = embedded.unify();
        let hidden =
            parts.layers.fold(hidden, |block, hidden| block_layer_forward(block, hidden, &rope, Some(&adaln)))?;
        Ok(parts.shell.get()?.finish(ZImageState { hidden, rope, adaln, layout }))
    }
}

/// The text encoder's parts: the token embedding and RoPE settings (`shell`) and its decoder layers.
pub struct TextEncoderParts {
    shell: ModuleOffload<TextEncoder>,
    layers: Streamed<DecoderLayer>,
    hidden_size: usize,
}

/// A Qwen3 `TextEncoder` under group offload.
pub type GroupedTextEncoder = GroupedModel<TextEncoderParts>;

impl GroupedTextEncoder {
    /// Takes `text_encoder` apart under `config` with `options`, as [`GroupedTransformer::new`] does; `ledger`
    /// is charged each call's activations.
    pub fn new(
        mut text_encoder: TextEncoder,
        config: GroupOffloadConfig,
        options: &GroupOptions,
        ledger: Arc<dyn DeviceLedger>,
    ) -> Result<Self> {
        let offload = options.offloader(config)?;
        let hidden_size = text_encoder.hidden_size();
        let layers = Streamed::new(&offload, "layers", std::mem::take(&mut text_encoder.layers), options.level)?;
        let shell = offload.module("shell", text_encoder, options.outside())?;
        let parts = TextEncoderParts { shell, layers, hidden_size };
        Ok(Self::assemble(offload, parts, ledger, "Qwen3Model", options.releasable))
    }

    /// `hidden_states[-2]` for right-padded ids `[batch, seq]` → `[batch, seq, hidden]`, as
    /// [`TextEncoder::forward`].
    pub fn forward(&self, input_ids: Tensor<2, Int>) -> Result<Tensor<3>> {
        self.offload().ensure_device(&input_ids.device())?;
        let (x, cos, sin) = self.parts.shell.get()?.embed(input_ids);
        self.parts.layers.fold(x, |layer, x| decoder_layer_forward(layer, x, cos.clone(), sin.clone()))
    }

    /// Each prompt's valid rows of `hidden_states[-2]`, as [`TextEncoder::encode`].
    pub fn encode(&self, input_ids: Tensor<2, Int>, attention_mask: Tensor<2, Bool>) -> Result<Vec<Tensor<2>>> {
        encode_valid_rows(input_ids, attention_mask, self.parts.hidden_size, |ids| self.forward(ids))
    }
}
