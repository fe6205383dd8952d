//! One trait for a model under offload: [`OffloadModel`].
//!
//! A model crate declares once which of its parts are block lists (and so which layers are leaves), and writes its
//! forward once, against its weights as a [`OffloadModel::Weights`] view. The view is the same type whether the
//! weights are resident (borrowed from the model) or streamed (handed out by group offload), so the resident
//! forward and the streamed forward are one function:
//!
//! - a block list is a [`Blocks`]: [`Blocks::fold`] walks its layers in order, each as a [`Layer`], taking each
//!   block group as it comes (block level) or each leaf as the layer's forward asks for it (leaf level);
//! - the layers outside the blocks are a [`Shell`]: [`Shell::get`] hands out the model's remaining weights,
//!   resident or streamed as one group;
//! - inside a layer, [`Layer::part`] takes the leaf group at a dotted path (`"attention.to_q"`): the whole layer
//!   when it is resident or taken by block, the one leaf's guard at leaf level.
//!
//! Taking the model apart ([`OffloadModel::split`]) moves each block list into a [`Split`], and the model's
//! [`census`](OffloadModel::census) names the same lists for the planner's layout ([`measure_layout`]).
//!
//! # A renamed field cannot break streaming silently
//!
//! A leaf's path is a string, so a rename is checked by a test every model gets for free: [`check_streaming`]
//! runs the forward resident, then under block-level and leaf-level group offload with prefetch, and fails with
//! [`Error::Streaming`] when the outputs differ, when a parameter was read outside the group that holds it (a
//! stray load: the forward used a weight through the wrong part), when a path names no group, when a group is
//! never taken, or when the census disagrees with the split. A rename that leaves the forward's path behind makes
//! the path name no group (an `UnknownGroup` error at leaf level) and its weights stray-load: both fail the check.

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use offload_core::plan::BlockLayout;

use crate::config::{GroupOffloadConfig, LeafPredicate};
use crate::error::{Error, Result};
use crate::parts::{BlockOffload, GroupGuard, GroupOffload, LeafOffload, ModuleOffload, Residency, leaf_groups};
use crate::whole::module_bytes;

/// A burn model that the manager can move whole and group offload can stream, with one forward for both.
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use group_offload::model::{Blocks, Census, OffloadModel, Shell, Split, check_streaming};
/// use group_offload::{Error, ModuleOffload};
/// use group_offload::model::Streamed;
///
/// #[derive(Module, Debug)]
/// struct Block { fc: Linear }
/// #[derive(Module, Debug)]
/// struct Mlp { blocks: Vec<Block>, head: Linear }
///
/// /// The weights as the forward reads them.
/// #[derive(Clone, Copy)]
/// struct MlpWeights<'a> { shell: Shell<'a, Mlp>, blocks: Blocks<'a, Block> }
/// /// The model taken apart.
/// struct MlpParts { shell: ModuleOffload<Mlp>, blocks: Streamed<Block> }
///
/// impl OffloadModel for Mlp {
///     const CLASS: &'static str = "Mlp";
///     type Weights<'a> = MlpWeights<'a>;
///     type Parts = MlpParts;
///     fn weights(&self) -> MlpWeights<'_> {
///         MlpWeights { shell: Shell::Resident(self), blocks: Blocks::Resident(&self.blocks) }
///     }
///     fn streamed(parts: &MlpParts) -> MlpWeights<'_> {
///         MlpWeights { shell: Shell::Streamed(&parts.shell), blocks: Blocks::Streamed(&parts.blocks) }
///     }
///     fn split(mut self, split: &Split<'_>) -> Result<MlpParts, Error> {
///         let blocks = split.blocks("blocks", std::mem::take(&mut self.blocks))?;
///         Ok(MlpParts { blocks, shell: split.shell(self)? })
///     }
///     fn census(&self, census: &mut Census) {
///         census.blocks(&self.blocks);
///     }
/// }
///
/// /// The one forward.
/// fn forward(weights: MlpWeights<'_>, x: Tensor<2>) -> Result<Tensor<2>, Error> {
///     let x = weights.blocks.fold(x, |block, x| Ok::<_, Error>(block.part(format_args!("fc"))?.fc.forward(x)))?;
///     Ok(weights.shell.get()?.head.forward(x))
/// }
///
/// let device = Device::flex();
/// let mlp = Mlp {
///     blocks: (0..3).map(|_| Block { fc: LinearConfig::new(8, 8).init(&device) }).collect(),
///     head: LinearConfig::new(8, 2).init(&device),
/// };
/// let x = Tensor::<2>::ones([1, 8], &device);
/// let check = check_streaming(mlp, &device, |weights| forward(weights, x.clone()))?;
/// assert_eq!(check.block_groups, 3);
/// # Ok::<(), Error>(())
/// ```
pub trait OffloadModel: Module + Send + 'static {
    /// The class the manager and the record show (`ZImageTransformer2DModel`).
    const CLASS: &'static str;

    /// The model's weights as its forward reads them: [`Blocks`] for each block list, a [`Shell`] for the rest.
    type Weights<'a>
    where
        Self: 'a;

    /// The model taken apart for group offload: a [`Streamed`] per block list, a [`ModuleOffload`] for the rest.
    /// A model with no block lists uses `std::convert::Infallible` (no parts exist) and keeps the default
    /// [`split`](Self::split), which refuses.
    type Parts: Send + Sync + 'static;

    /// The weights of the resident model.
    fn weights(&self) -> Self::Weights<'_>;

    /// The weights of the model under group offload.
    fn streamed(parts: &Self::Parts) -> Self::Weights<'_>;

    /// Takes the model apart: each block list into [`Split::blocks`], then what is left into [`Split::shell`].
    ///
    /// The default refuses: the model declares no block lists, so it moves only whole.
    fn split(self, split: &Split<'_>) -> Result<Self::Parts> {
        Err(Error::RouteUnsupported {
            component: split.offload().config().model.clone(),
            route: "group offload".into(),
            reason: format!(
                "{} declares no block lists (OffloadModel::split), so it moves only whole, under component offload \
                 (the default when auto offload is on)",
                Self::CLASS
            ),
        })
    }

    /// Names the same block lists as [`split`](Self::split), in the order the forward runs them, with
    /// [`Census::blocks`] (and the leaf each block's forward takes first, [`Census::first_leaf`]): the planner's
    /// layout comes from it ([`measure_layout`]). The default names none.
    fn census(&self, census: &mut Census) {
        let _ = census;
    }

    /// The layer types whose modules are leaf groups at leaf level: burn's layers by default.
    fn leaf_types() -> LeafPredicate {
        LeafPredicate::default_layers()
    }
}

/// How a component's layers are cut into groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupLevel {
    /// Runs of consecutive layers (blocks) form a group.
    Block {
        /// Consecutive blocks uploaded as one group (at least 1).
        blocks_per_group: usize,
    },
    /// Every leaf layer (a linear layer, say) of every block is a group, and each block's norms one more.
    Leaf,
}

/// How a model is streamed: the level, the prefetch, the budgets, the store, whether the manager may release it.
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
    pub disk_store: Option<std::path::PathBuf>,
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
    pub fn validate(&self, model: &str) -> Result<()> {
        let invalid = |problem: &str| Err(Error::InvalidConfig { model: model.into(), problem: problem.into() });
        if self.level == (GroupLevel::Block { blocks_per_group: 0 }) {
            return invalid("blocks_per_group is 0; group at least 1 block");
        }
        if self.prefetch && self.prefetch_depth == 0 {
            return invalid("prefetch_depth is 0 with prefetch on; use 1 or more, or turn prefetch off");
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

    /// Where the layers outside the blocks live: resident when kept, streamed as one group otherwise.
    pub fn outside(&self) -> Residency {
        if self.keep_outside { Residency::Resident } else { Residency::Streamed }
    }
}

/// What a model is taken apart into: the offloader, the level and the leaf types. See [`OffloadModel::split`].
pub struct Split<'a> {
    offload: &'a GroupOffload,
    level: GroupLevel,
    leaves: LeafPredicate,
    outside: Residency,
}

impl<'a> Split<'a> {
    /// A split into `offload` at `options`' level, cutting leaves with `leaves`.
    pub fn new(offload: &'a GroupOffload, options: &GroupOptions, leaves: LeafPredicate) -> Self {
        Self { offload, level: options.level, leaves, outside: options.outside() }
    }

    /// The offloader the parts go into.
    pub fn offload(&self) -> &GroupOffload {
        self.offload
    }

    /// Moves a block list into the offloader as the part `name` (block level: groups of consecutive blocks;
    /// leaf level: one leaf-level part `{name}.{i}` per block).
    pub fn blocks<B: Module>(&self, name: &str, blocks: Vec<B>) -> Result<Streamed<B>> {
        Ok(match self.level {
            GroupLevel::Block { blocks_per_group } => {
                Streamed::Blocks(self.offload.blocks(name, blocks, blocks_per_group)?)
            }
            GroupLevel::Leaf => Streamed::Leaves(
                blocks
                    .into_iter()
                    .enumerate()
                    .map(|(i, block)| self.offload.leaves(&format!("{name}.{i}"), block, &self.leaves))
                    .collect::<Result<Vec<_>>>()?,
            ),
        })
    }

    /// Moves what is left of the model (the layers outside the blocks) in as the part `shell`: resident, or
    /// streamed as one group when the options do not keep it.
    pub fn shell<M: Module>(&self, module: M) -> Result<ModuleOffload<M>> {
        self.offload.module("shell", module, self.outside)
    }
}

/// A block list under group offload at either level.
pub enum Streamed<B> {
    /// Block level: groups of consecutive blocks.
    Blocks(BlockOffload<B>),
    /// Leaf level: one leaf-level part per block, named `{name}.{i}`.
    Leaves(Vec<LeafOffload<B>>),
}

impl<B> std::fmt::Debug for Streamed<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Streamed::Blocks(blocks) => f.debug_tuple("Blocks").field(blocks).finish(),
            Streamed::Leaves(layers) => f.debug_tuple("Leaves").field(&layers.len()).finish(),
        }
    }
}

/// A block list as the forward reads it: resident, or streamed.
pub enum Blocks<'a, B> {
    /// The blocks, all where they run.
    Resident(&'a [B]),
    /// The blocks under group offload.
    Streamed(&'a Streamed<B>),
}

impl<B> Clone for Blocks<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Blocks<'_, B> {}

impl<B: Module> Blocks<'_, B> {
    /// Runs `step` over every block in order, threading `state` through: a resident block or a block group taken
    /// whole is a [`Layer::Whole`], a leaf-level block hands out its parts one at a time.
    pub fn fold<T, E: From<Error>>(
        self,
        mut state: T,
        mut step: impl FnMut(Layer<'_, B>, T) -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        match self {
            Blocks::Resident(blocks) => {
                for block in blocks {
                    state = step(Layer::Whole(block), state)?;
                }
            }
            Blocks::Streamed(Streamed::Blocks(blocks)) => {
                for group in blocks.iter() {
                    let group = group?;
                    for block in group.iter() {
                        state = step(Layer::Whole(block), state)?;
                    }
                }
            }
            Blocks::Streamed(Streamed::Leaves(blocks)) => {
                for block in blocks {
                    state = step(Layer::Leaves(block), state)?;
                }
            }
        }
        Ok(state)
    }
}

/// The layers outside the blocks as the forward reads them: the resident model, or its shell under offload.
pub enum Shell<'a, M> {
    /// The model itself (its block lists are there too, unused by the shell's calls).
    Resident(&'a M),
    /// The shell part: resident on the device, or streamed as one group.
    Streamed(&'a ModuleOffload<M>),
}

impl<M> Clone for Shell<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M> Copy for Shell<'_, M> {}

impl<'a, M: Module> Shell<'a, M> {
    /// The shell's weights on the device while the returned part lives.
    pub fn get(self) -> Result<Part<'a, M>> {
        match self {
            Shell::Resident(model) => Ok(Part::Whole(model)),
            Shell::Streamed(shell) => Ok(Part::Guard(shell.get()?)),
        }
    }
}

/// Where one layer's weights come from during one forward.
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
    /// The part at `path` (`format_args!("")` for the layer's own norms, which travel with the struct that
    /// holds them): the whole layer, or a guard holding the leaf group at `path` on the device while it lives.
    /// The path is formatted only for a leaf-level layer, so the resident forward builds no strings. A path that
    /// names no group is [`Error::UnknownGroup`].
    pub fn part(self, path: std::fmt::Arguments<'_>) -> Result<Part<'a, M>> {
        match self {
            Layer::Whole(module) => Ok(Part::Whole(module)),
            Layer::Leaves(leaves) => Ok(Part::Guard(leaves.group(&path.to_string())?)),
        }
    }

    /// The part at `path` when the layer has one there (an optional sub-layer, absent in some configurations);
    /// always the whole layer for [`Layer::Whole`].
    pub fn optional_part(self, path: std::fmt::Arguments<'_>) -> Result<Option<Part<'a, M>>> {
        match self {
            Layer::Whole(module) => Ok(Some(Part::Whole(module))),
            Layer::Leaves(leaves) => {
                let path = path.to_string();
                if leaves.group_paths().contains(&path.as_str()) {
                    Ok(Some(Part::Guard(leaves.group(&path)?)))
                } else {
                    Ok(None)
                }
            }
        }
    }
}

/// One part of a model's weights, dereferencing to the module (only the part's own weights are guaranteed on the
/// device under leaf-level offload).
pub enum Part<'a, M> {
    /// The whole module, where it runs.
    Whole(&'a M),
    /// A group's guard: the group stays on the device while it lives.
    Guard(GroupGuard<'a, M>),
}

impl<M> std::ops::Deref for Part<'_, M> {
    type Target = M;

    fn deref(&self) -> &M {
        match self {
            Part::Whole(module) => module,
            Part::Guard(guard) => guard,
        }
    }
}

/// The value of a forward over resident weights, which take no group and so cannot fail with a group error: the
/// resident `forward` of a model is `whole(forward(model.weights(), ..))`.
pub fn whole<T, E: std::fmt::Display>(result: std::result::Result<T, E>) -> T {
    match result {
        Ok(value) => value,
        // Resident weights hand out themselves for every part; no path reaches an error.
        Err(error) => unreachable!("a resident forward took a group: {error}"),
    }
}

/// The block lists a model names for the planner ([`OffloadModel::census`]).
#[derive(Debug, Default, Clone)]
pub struct Census {
    leaves: Option<LeafPredicate>,
    /// Per block, in execution order: its bytes and its leaf groups.
    blocks: Vec<(u64, Vec<(String, u64)>)>,
    /// Per block list, its number of blocks.
    lists: Vec<usize>,
    first_leaf: String,
}

impl Census {
    /// An empty census that cuts leaves with `leaves`.
    pub fn new(leaves: LeafPredicate) -> Self {
        Self { leaves: Some(leaves), ..Self::default() }
    }

    /// A block list, in the order the forward runs it.
    pub fn blocks<B: Module>(&mut self, blocks: &[B]) {
        let leaves = self.leaves.clone().unwrap_or_default();
        self.lists.push(blocks.len());
        self.blocks.extend(blocks.iter().map(|block| (module_bytes(block), leaf_groups(block, &leaves))));
    }

    /// The leaf group a block's forward takes first (`""`, the block's norms, unless set): the planner sizes the
    /// first upload of a leaf-level forward by it.
    pub fn first_leaf(&mut self, path: &str) {
        self.first_leaf = path.to_string();
    }

    /// How many blocks each list has, in order.
    pub fn list_lengths(&self) -> &[usize] {
        &self.lists
    }
}

/// The planner's layout of `model`, measured from its loaded parameters and its census: each block's bytes in
/// execution order, the bytes outside the blocks, the leaf groups inside the blocks (leaf level keeps the layers
/// outside the blocks resident, as block level does) and the first leaf's bytes. `None` for a model that names no
/// block list.
pub fn measure_layout<M: OffloadModel>(model: &M) -> Option<BlockLayout> {
    let mut census = Census::new(M::leaf_types());
    model.census(&mut census);
    if census.lists.is_empty() {
        return None;
    }
    let block_bytes: Vec<u64> = census.blocks.iter().map(|(bytes, _)| *bytes).collect();
    let leaves = census.blocks.iter().flat_map(|(_, groups)| groups);
    let largest_leaf_bytes = leaves.clone().map(|(_, bytes)| *bytes).max().unwrap_or(0);
    let first_leaf_bytes = census
        .blocks
        .iter()
        .find_map(|(_, groups)| groups.iter().find(|(path, _)| *path == census.first_leaf).map(|(_, b)| *b))
        .unwrap_or(0);
    Some(BlockLayout {
        outside_bytes: module_bytes(model).saturating_sub(block_bytes.iter().sum()),
        block_bytes,
        largest_leaf_bytes,
        leaf_count: leaves.count(),
        first_leaf_bytes,
    })
}

/// What [`check_streaming`] ran and found.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamingCheck {
    /// Groups at block level (one block per group).
    pub block_groups: usize,
    /// Groups at leaf level.
    pub leaf_groups: usize,
    /// The largest difference of a streamed output from the resident one, relative to the largest resident value.
    pub max_relative_difference: f32,
}

/// The test every [`OffloadModel`] gets for free: runs `forward` on the resident model, then twice (the capture,
/// then prefetched) under block-level and under leaf-level group offload on `device`, and checks that
///
/// - every streamed output equals the resident one (within 1e-4 of the largest value);
/// - no parameter was loaded outside the group that holds it (no stray loads), and every path named a group;
/// - every group was taken;
/// - the census names as many blocks as the split made block groups.
///
/// Fails with [`Error::Streaming`], naming the level and what to fix. The model is cloned for each run.
pub fn check_streaming<M, const D: usize, E>(
    model: M,
    device: &Device,
    forward: impl for<'a> Fn(M::Weights<'a>) -> std::result::Result<Tensor<D>, E>,
) -> Result<StreamingCheck>
where
    M: OffloadModel + Clone,
    E: std::fmt::Display,
{
    let failed =
        |level: &str, problem: String| Error::Streaming { model: M::CLASS.to_string(), level: level.into(), problem };
    let reference = forward(model.weights()).map_err(|e| failed("resident", e.to_string()))?;
    let scale = reference.clone().abs().max().into_scalar::<f32>().max(f32::MIN_POSITIVE);
    let mut census = Census::new(M::leaf_types());
    model.census(&mut census);
    let mut check = StreamingCheck { block_groups: 0, leaf_groups: 0, max_relative_difference: 0.0 };
    for (name, options) in [("block level", GroupOptions::default()), ("leaf level", GroupOptions::leaf())] {
        let config = options.configure(GroupOffloadConfig::new(M::CLASS, device.clone()));
        let offload = GroupOffload::new(config)?;
        let parts = model.clone().split(&Split::new(&offload, &options, M::leaf_types()))?;
        for _ in 0..2 {
            let out = forward(M::streamed(&parts)).map_err(|e| failed(name, e.to_string()))?;
            let difference = (out - reference.clone()).abs().max().into_scalar::<f32>() / scale;
            check.max_relative_difference = check.max_relative_difference.max(difference);
            if difference.is_nan() || difference > 1e-4 {
                return Err(failed(
                    name,
                    format!(
                        "the streamed output differs from the resident one by {difference:e} of its largest value; the forward reads different weights when streamed"
                    ),
                ));
            }
        }
        offload.wait_idle();
        let stats = offload.stats();
        if stats.stray_loads > 0 {
            return Err(failed(
                name,
                format!(
                    "{} parameter(s) were loaded outside their group (first: {}); the forward used a weight through a part that does not hold it: take the part at the weight's own path (Layer::part)",
                    stats.stray_loads,
                    offload.stray_parameters().first().cloned().unwrap_or_default()
                ),
            ));
        }
        let order = offload.order();
        let groups = offload.groups();
        if let Some((never, _)) = groups.iter().find(|(id, _)| !order.contains(id)) {
            return Err(failed(
                name,
                format!(
                    "group {never} was never taken; the forward skips its weights, or reaches them under another path"
                ),
            ));
        }
        match options.level {
            GroupLevel::Block { .. } => {
                check.block_groups = groups.iter().filter(|(id, _)| !id.ends_with("/shell")).count();
                let named: usize = census.list_lengths().iter().sum();
                if named != check.block_groups {
                    return Err(failed(
                        name,
                        format!(
                            "the census names {named} blocks but the split made {} block groups; name the same block lists in census and split",
                            check.block_groups
                        ),
                    ));
                }
            }
            GroupLevel::Leaf => check.leaf_groups = groups.len(),
        }
    }
    Ok(check)
}

/// Declares a burn model to offload once: its class name and, for a model that streams, its block lists (fields
/// of type `Vec<Block>`, in the order the forward runs them). It writes the model's [`OffloadModel`] impl, a
/// `Copy` weights view (`shell` and one [`Blocks`] per list, all `pub`) that the model's one forward is written
/// against, and the parts struct group offload fills.
///
/// The block lists are named by their fields, so a renamed field is a compile error, and each list's group
/// names are its field's name (`layers_0_0`, or `layers.0.attn.q` at leaf level).
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use group_offload::{Error, check_streaming, offload_model};
///
/// #[derive(Module, Debug)]
/// struct Block { fc: Linear }
/// #[derive(Module, Debug)]
/// struct Mlp { blocks: Vec<Block>, head: Linear }
///
/// offload_model!(Mlp as "Mlp", weights MlpWeights, parts MlpParts { blocks: Block });
///
/// /// The one forward, resident or streamed.
/// fn forward(weights: MlpWeights<'_>, x: Tensor<2>) -> Result<Tensor<2>, Error> {
///     let x = weights.blocks.fold(x, |block, x| Ok::<_, Error>(block.part(format_args!("fc"))?.fc.forward(x)))?;
///     Ok(weights.shell.get()?.head.forward(x))
/// }
///
/// let device = Device::flex();
/// let blocks = (0..3).map(|_| Block { fc: LinearConfig::new(8, 8).init(&device) }).collect();
/// let mlp = Mlp { blocks, head: LinearConfig::new(8, 2).init(&device) };
/// let x = Tensor::<2>::ones([1, 8], &device);
/// assert_eq!(check_streaming(mlp, &device, |weights| forward(weights, x.clone()))?.block_groups, 3);
/// # Ok::<(), Error>(())
/// ```
///
/// Options after the lists: `first leaf "path"` (the leaf a block's forward takes first, for the planner) and
/// `leaves EXPR` (a [`LeafPredicate`] other than burn's layers). A model without block lists is declared
/// `offload_model!(Decoder as "Decoder");`: its weights are `&Decoder` and it moves only whole.
#[macro_export]
macro_rules! offload_model {
    ($model:ident as $class:literal) => {
        impl $crate::OffloadModel for $model {
            const CLASS: &'static str = $class;
            type Weights<'a> = &'a $model;
            type Parts = ::std::convert::Infallible;
            fn weights(&self) -> &$model {
                self
            }
            fn streamed(parts: &::std::convert::Infallible) -> &$model {
                match *parts {}
            }
        }
    };
    ($model:ident as $class:literal, weights $weights:ident, parts $parts:ident { $($list:ident : $block:ty),+ $(,)? }
        $(, first leaf $first:literal)? $(, leaves $leaves:expr)? $(,)?) => {
        #[doc = concat!("The weights of [`", stringify!($model), "`] as its forward reads them, resident or streamed.")]
        #[derive(Clone, Copy)]
        pub struct $weights<'a> {
            /// The layers outside the block lists.
            pub shell: $crate::Shell<'a, $model>,
            $(
                #[doc = concat!("The block list `", stringify!($list), "`.")]
                pub $list: $crate::Blocks<'a, $block>,
            )+
        }

        #[doc = concat!("[`", stringify!($model), "`] taken apart for group offload.")]
        pub struct $parts {
            shell: $crate::ModuleOffload<$model>,
            $($list: $crate::Streamed<$block>,)+
        }

        impl $crate::OffloadModel for $model {
            const CLASS: &'static str = $class;
            type Weights<'a> = $weights<'a>;
            type Parts = $parts;
            fn weights(&self) -> $weights<'_> {
                $weights { shell: $crate::Shell::Resident(self), $($list: $crate::Blocks::Resident(&self.$list),)+ }
            }
            fn streamed(parts: &$parts) -> $weights<'_> {
                $weights {
                    shell: $crate::Shell::Streamed(&parts.shell),
                    $($list: $crate::Blocks::Streamed(&parts.$list),)+
                }
            }
            fn split(mut self, split: &$crate::Split<'_>) -> $crate::Result<$parts> {
                $(let $list = split.blocks(stringify!($list), ::std::mem::take(&mut self.$list))?;)+
                Ok($parts { shell: split.shell(self)?, $($list,)+ })
            }
            fn census(&self, census: &mut $crate::Census) {
                $(census.blocks(&self.$list);)+
                $(census.first_leaf($first);)?
            }
            $(fn leaf_types() -> $crate::LeafPredicate {
                $leaves
            })?
        }
    };
}

/// Takes the leaf at a field path of a [`Layer`] and evaluates to that field: `leaf!(block, attention.to_q)` is
/// `block.part(format_args!("attention.to_q"))?.attention.to_q`. The group's path and the field it names are the
/// same tokens, so renaming the field is a compile error here rather than a path left behind (which
/// [`check_streaming`] would catch at test time). Use it inside a function whose error type is
/// `From<group_offload::Error>`; the part stays on the device until the end of the statement.
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use group_offload::{Error, Layer, leaf};
///
/// #[derive(Module, Debug)]
/// struct Mlp { up: Linear, down: Linear }
///
/// fn forward(mlp: Layer<'_, Mlp>, x: Tensor<2>) -> Result<Tensor<2>, Error> {
///     let h = leaf!(mlp, up).forward(x);
///     Ok(leaf!(mlp, down).forward(h))
/// }
///
/// let device = Device::flex();
/// let mlp = Mlp { up: LinearConfig::new(4, 8).init(&device), down: LinearConfig::new(8, 4).init(&device) };
/// assert_eq!(forward(Layer::Whole(&mlp), Tensor::<2>::ones([1, 4], &device))?.dims(), [1, 4]);
/// # Ok::<(), Error>(())
/// ```
///
/// Parameters under no leaf (a norm's weight) travel with the struct that holds them: take that group with
/// `layer.part(format_args!(""))` (a block's own parameters), as the field path names no group of its own.
#[macro_export]
macro_rules! leaf {
    ($layer:expr, $first:ident $(. $rest:ident)*) => {
        $layer
            .part(::core::format_args!(::core::concat!(::core::stringify!($first) $(, ".", ::core::stringify!($rest))*)))?
            .$first$(.$rest)*
    };
}
