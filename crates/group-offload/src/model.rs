//! One trait for a model under offload: [`OffloadModel`], usually derived.
//!
//! A model crate declares once, on the struct it already has, which of its fields are parts that stream
//! (`#[derive(OffloadModel)]`, see [`OffloadModel`]): block lists, single blocks, and nested sub-models with
//! lists of their own (a UNet's stages). It writes its forward once, against its weights as a
//! [`OffloadModel::Weights`] view ([`crate::view`]). The view is the same type whether the weights are resident
//! (borrowed from the model) or streamed (handed out by group offload), so the resident forward and the streamed
//! forward are one function.
//!
//! Taking the model apart ([`OffloadModel::split`]) moves each declared part into a [`Split`], and the model's
//! [`census`](OffloadModel::census) names the same parts for the planner's layout ([`measure_layout`]).
//! Checkpoint keys never change: the struct is the one burn loads and saves.
//!
//! # A renamed field cannot break streaming
//!
//! The derive names every part by its field and [`leaf!`](crate::leaf) and [`narrow!`](crate::narrow) name every
//! leaf by its field path, so a rename is a compile error. A path written by hand ([`Layer::part_at`](crate::Layer::part_at)) is caught
//! by the test every model gets for free: [`check_streaming`] runs the forward resident, then under block-level
//! and leaf-level group offload with prefetch, and fails with [`Error::Streaming`] when the outputs differ, when
//! a parameter was read outside the group that holds it (a stray load), when a path names no group, when a group
//! is never taken, when the second forward missed a prefetch or learnt a new step, or when the census disagrees
//! with the split.

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Device, Tensor};
use offload_core::plan::BlockLayout;

use crate::config::{GroupOffloadConfig, LeafPredicate};
use crate::error::{Error, Result};
use crate::parts::{BlockOffload, GroupOffload, LeafOffload, ModuleOffload, Residency, leaf_groups_with};
use crate::weights::FileTable;
use crate::whole::module_bytes_with;

/// A burn model that the manager can move whole and group offload can stream, with one forward for both.
///
/// Derive it on the model's struct, marking the fields that stream; the derive writes the `{Model}Weights<'a>`
/// view the forward reads and the `{Model}Parts` group offload fills:
///
/// | attribute | on a field of type | in the view | at block level |
/// |---|---|---|---|
/// | `#[offload(blocks)]` | `Vec<B>` | [`Blocks<'a, B>`](crate::Blocks) | a group per block |
/// | `#[offload(block)]` | `B` | [`Single<'a, B>`](crate::Single) | one group |
/// | `#[offload(nested)]` | `Vec<S>`, `S: OffloadModel` | [`Nested<'a, S>`](crate::Nested) | each element's parts and rest |
/// | `#[offload(nested)]` | `S: OffloadModel` | `S::Weights<'a>` | its parts and its rest |
///
/// `#[offload(blocks, first = adaLN_modulation[0])]` names the leaf a block's forward takes first (the planner
/// sizes a leaf-level forward's first upload by it; checked against the block's fields). On the struct,
/// `#[offload(class = "UNet2DConditionModel")]` is the class the record shows (the struct's name by default) and
/// `#[offload(leaves = path::to_fn)]` a function returning the [`LeafPredicate`] that cuts leaves (burn's layers
/// by default). Everything not marked is the `shell`. A struct with no marked field moves only whole: its view
/// is `&Self`.
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use group_offload::prelude::*;
///
/// #[derive(Module, Debug)]
/// struct Block { fc: Linear }
/// #[derive(Module, Debug, OffloadModel)]
/// struct Mlp { #[offload(blocks)] blocks: Vec<Block>, head: Linear }
///
/// impl MlpWeights<'_> {
///     /// The one forward, resident or streamed.
///     fn forward(self, x: Tensor<2>) -> Result<Tensor<2>> {
///         let x = self.blocks.fold(x, |block, x| Ok(leaf!(block, fc).forward(x)))?;
///         Ok(self.shell.get()?.head.forward(x))
///     }
/// }
///
/// let device = Device::flex();
/// let blocks = (0..3).map(|_| Block { fc: LinearConfig::new(8, 8).init(&device) }).collect();
/// let mlp = Mlp { blocks, head: LinearConfig::new(8, 2).init(&device) };
/// let x = Tensor::<2>::ones([1, 8], &device);
/// assert_eq!(check_streaming(mlp, &device, |weights| weights.forward(x.clone()))?.block_groups, 3);
/// # Ok::<(), group_offload::Error>(())
/// ```
///
/// Written by hand, the impl names the same parts in [`split`](Self::split) and [`census`](Self::census).
pub trait OffloadModel: Module + Send + 'static {
    /// The class the manager and the record show (`ZImageTransformer2DModel`).
    const CLASS: &'static str;

    /// The model's weights as its forward reads them: a view per declared part, a [`Shell`](crate::Shell) for
    /// the rest.
    type Weights<'a>: Copy
    where
        Self: 'a;

    /// The model taken apart for group offload. A model with no declared parts uses
    /// `std::convert::Infallible` (no parts exist) and keeps the default [`split`](Self::split), which refuses.
    type Parts: Send + Sync + 'static;

    /// The weights of the resident model.
    fn weights(&self) -> Self::Weights<'_>;

    /// The weights of the model under group offload.
    fn streamed(parts: &Self::Parts) -> Self::Weights<'_>;

    /// Takes the model apart: each declared part into the [`Split`] ([`Split::blocks`], [`Split::block`],
    /// [`Split::nested`], [`Split::nested_one`]), then what is left into [`Split::shell`].
    ///
    /// The default refuses: the model declares no parts, so it moves only whole.
    fn split(self, split: &Split<'_>) -> Result<Self::Parts> {
        Err(Error::RouteUnsupported {
            component: split.offload().config().model.clone(),
            route: "group offload".into(),
            reason: format!(
                "{} declares no parts that stream (no #[offload(..)] field), so it moves only whole, under \
                 component offload (the default when auto offload is on)",
                Self::CLASS
            ),
        })
    }

    /// Names the same parts as [`split`](Self::split), in the order the forward runs them ([`Census::blocks_from`],
    /// [`Census::nested`]): the planner's layout comes from it ([`measure_layout`]). The default names none.
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
    /// Bytes of streamed groups read from a file (the checkpoint file of a model registered from its files, or
    /// the disk store) whose read stays in host memory for later uploads (0 by default): the split of the
    /// streamed groups over RAM and the file that the planner places by cost
    /// ([`GroupOffloadConfig::ram_budget`]).
    pub ram_budget: u64,
    /// The most bytes of groups each donor device holds, by the device's name, as a plan placed them
    /// ([`ComponentPlan::peers`](offload_core::plan::ComponentPlan::peers)): a donor given to the model
    /// ([`PeerDonor`](crate::config::PeerDonor)) holds at most its entry here, and nothing where it has none, and
    /// the donors are tried in this list's order (the plan's peers', as its model of the run fills them). Empty (the
    /// default): each donor holds up to its own budget, tried in the order added.
    pub donor_budgets: Vec<(String, u64)>,
    /// Where a plan knows each streamed group's size, the sizes of the groups it pins: the pinned budget then pins
    /// only groups of these sizes, one each, so the run pins the groups the plan placed on pinned memory
    /// ([`ComponentPlan::pinned_groups`](offload_core::plan::ComponentPlan::pinned_groups)). Empty (the default):
    /// the first streamed groups that fit the budget.
    pub pinned_groups: Vec<u64>,
    /// Where a plan knows each streamed group's size, the sizes of the groups whose reads stay in host memory: the
    /// RAM budget then keeps only groups of these sizes, one each
    /// ([`ComponentPlan::ram_streamed_groups`](offload_core::plan::ComponentPlan::ram_streamed_groups)). Empty (the
    /// default): the groups that fit the budget, in upload order.
    pub ram_groups: Vec<u64>,
    /// Where a plan knows each streamed group's size, the sizes of the groups each donor holds, by the donor
    /// device's name: a donor then takes only groups of these sizes, one each
    /// ([`PeerShare::group_bytes`](offload_core::plan::PeerShare::group_bytes)), so the run holds the placement the
    /// plan's search chose. Empty (the default): each donor takes the groups that fit its budget, in upload order.
    pub donor_groups: Vec<(String, Vec<u64>)>,
    /// Whether the manager may release the component whole (every group, the resident ones included) when
    /// another component comes onto the device. Phase-staged plans set it, so the next phase gets the memory
    /// this component's resident groups held; with `false` the manager never evicts it (group offload's default).
    pub releasable: bool,
    /// Whether the layers outside the blocks stay on the device (the default, at either level) or stream as one
    /// group like the blocks (the planner's full-pin rule).
    pub keep_outside: bool,
    /// Whether each upload is synced and read back before its group is published (the default): a refused
    /// allocation or a lost device is then this group's typed error, on the thread that uploaded it. Without,
    /// the group is published as soon as its copies are queued, and such a failure surfaces at the end of the
    /// call that uses it, typed as that call's error (`cargo xtask bench offload` measures the difference).
    pub check_uploads: bool,
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
            ram_budget: 0,
            donor_budgets: Vec::new(),
            pinned_groups: Vec::new(),
            ram_groups: Vec::new(),
            donor_groups: Vec::new(),
            releasable: false,
            keep_outside: true,
            check_uploads: true,
        }
    }
}

impl GroupOptions {
    /// Leaf level: prefetch depth 1, no resident budget, the layers outside the blocks resident, host memory
    /// store, never released whole.
    pub fn leaf() -> Self {
        Self { level: GroupLevel::Leaf, ..Self::default() }
    }

    /// Checks what a caller can get wrong, before anything is taken apart: `blocks_per_group` of 1 or more (any
    /// count past the number of blocks is one group of every block, and nothing is allocated or looped by it),
    /// and the prefetch depth by the rule [`GroupOffloadConfig::validate`] applies (1 to
    /// [`MAX_PREFETCH_DEPTH`](offload_core::plan::MAX_PREFETCH_DEPTH) with prefetch on, never past the bound).
    /// Each refusal is [`Error::InvalidConfig`] naming the value, the bound and the fix.
    pub fn validate(&self, model: &str) -> Result<()> {
        if self.level == (GroupLevel::Block { blocks_per_group: 0 }) {
            let problem = "blocks_per_group is 0; use 1 or more (one group of that many consecutive blocks)".into();
            return Err(Error::InvalidConfig { model: model.into(), problem });
        }
        // The prefetch rule is the offloader's own (one function, one message): these options are checked by it
        // here, early, so that a handle refuses them before it touches the model; `configure` then trusts them.
        crate::config::check_prefetch(model, self.prefetch, self.prefetch_depth)
    }

    /// `config` (device, ledger, readings, record) with these options' prefetch, budgets and disk store. It
    /// passes the values on as they are: [`validate`](Self::validate) checks them, and the offloader that the
    /// configuration starts checks them again with [`GroupOffloadConfig::validate`], so nothing is clamped here.
    pub fn configure(&self, config: GroupOffloadConfig) -> GroupOffloadConfig {
        let config = config
            .with_prefetch(self.prefetch)
            .with_prefetch_depth(self.prefetch_depth)
            .with_resident_budget(self.resident_budget)
            .with_pinned_budget(self.pinned_budget)
            .with_ram_budget(self.ram_budget)
            .with_upload_checks(self.check_uploads)
            .with_donor_budgets(&self.donor_budgets)
            .with_placed_sizes(&self.pinned_groups, &self.ram_groups, &self.donor_groups);
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

/// What a model is taken apart into: the offloader, the level, the leaf types, and where in the model the part
/// being split sits. See [`OffloadModel::split`].
pub struct Split<'a> {
    offload: &'a GroupOffload,
    level: GroupLevel,
    leaves: LeafPredicate,
    outside: Residency,
    /// The dotted path of the sub-model being split, with a trailing dot (`"down_blocks.0."`); empty at the top.
    prefix: String,
}

impl<'a> Split<'a> {
    /// A split into `offload` at `options`' level, cutting leaves with `leaves`.
    pub fn new(offload: &'a GroupOffload, options: &GroupOptions, leaves: LeafPredicate) -> Self {
        Self { offload, level: options.level, leaves, outside: options.outside(), prefix: String::new() }
    }

    /// The offloader the parts go into.
    pub fn offload(&self) -> &GroupOffload {
        self.offload
    }

    fn name(&self, field: &str) -> String {
        format!("{}{field}", self.prefix)
    }

    fn child(&self, field: &str) -> Split<'a> {
        Split { prefix: format!("{}{field}.", self.prefix), leaves: self.leaves.clone(), ..*self }
    }

    /// Moves a block list into the offloader as the part `name` (block level: groups of consecutive blocks
    /// named `{name}_{first}_{last}`; leaf level: one leaf-level part `{name}.{i}` per block).
    pub fn blocks<B: Module>(&self, name: &str, blocks: Vec<B>) -> Result<Streamed<B>> {
        let name = self.name(name);
        Ok(match self.level {
            GroupLevel::Block { blocks_per_group } => {
                Streamed::Blocks(self.offload.blocks(&name, blocks, blocks_per_group)?)
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

    /// Moves one module into the offloader as a group of its own named `name` (block level), or cut at its
    /// leaves (leaf level).
    pub fn block<B: Module>(&self, name: &str, block: B) -> Result<StreamedOne<B>> {
        let name = self.name(name);
        Ok(match self.level {
            GroupLevel::Block { .. } => StreamedOne::Group(self.offload.module(&name, block, Residency::Streamed)?),
            GroupLevel::Leaf => StreamedOne::Leaves(self.offload.leaves(&name, block, &self.leaves)?),
        })
    }

    /// Takes apart each element of a list of declared sub-models, element `i` under the path `{name}.{i}`.
    pub fn nested<S: OffloadModel>(&self, name: &str, elements: Vec<S>) -> Result<Vec<S::Parts>> {
        elements
            .into_iter()
            .enumerate()
            .map(|(i, element)| element.split(&self.child(&format!("{name}.{i}"))))
            .collect()
    }

    /// Takes apart one declared sub-model under the path `name`.
    pub fn nested_one<S: OffloadModel>(&self, name: &str, element: S) -> Result<S::Parts> {
        element.split(&self.child(name))
    }

    /// Moves what is left of the model (the layers outside its declared parts) in: at the top the part `shell`,
    /// resident, or streamed as one group when the options do not keep it; inside a nested sub-model a streamed
    /// group named by the sub-model's path (`down_blocks.0`), resident when it holds no weights.
    pub fn shell<M: Module>(&self, module: M) -> Result<ModuleOffload<M>> {
        if self.prefix.is_empty() {
            return self.offload.module("shell", module, self.outside);
        }
        let files = self.offload.config().files.as_ref();
        let residency =
            if module_bytes_with(&module, None, files) == 0 { Residency::Resident } else { Residency::Streamed };
        self.offload.module(self.prefix.trim_end_matches('.'), module, residency)
    }

    /// Takes a field that is not a `Vec` out of the model, leaving a hollow copy in its place: the same
    /// structure with every float weight zero-sized, so the shell holds none of its bytes and a weight read
    /// through the shell fails loudly (a shape error) instead of reading another group's weights.
    pub fn hollow<T: Module>(&self, field: &mut T) -> T {
        let hollow = field.clone().map(&mut Hollower { device: self.offload.config().device.exec().clone() });
        std::mem::replace(field, hollow)
    }
}

/// Replaces every float parameter with a zero-sized one.
struct Hollower {
    device: Device,
}

impl ModuleMapper for Hollower {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        drop(param);
        // Zero elements, with every dimension but the first 1: a shape the backends reshape without dividing by 0.
        let mut shape = [1; D];
        shape[0] = 0;
        Param::initialized(ParamId::new(), Tensor::zeros(shape, &self.device))
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

/// One module under group offload at either level ([`Split::block`]).
pub enum StreamedOne<B> {
    /// Block level: the module is one group.
    Group(ModuleOffload<B>),
    /// Leaf level: the module cut at its leaves.
    Leaves(LeafOffload<B>),
}

impl<B> std::fmt::Debug for StreamedOne<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamedOne::Group(group) => f.debug_tuple("Group").field(group).finish(),
            StreamedOne::Leaves(leaves) => f.debug_tuple("Leaves").field(leaves).finish(),
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

/// One entry of a census: a unit that is one group at block level.
#[derive(Debug, Clone)]
struct CensusBlock {
    bytes: u64,
    /// Its leaf groups at leaf level.
    leaves: Vec<(String, u64)>,
    /// The leaf group its forward takes first (`""`: its own parameters), by `leaf!`'s rules; `None` where the
    /// block holds no weights at the path it was given (an optional layer that is `None` in this block).
    first: Option<String>,
}

/// The parts a model names for the planner ([`OffloadModel::census`]), in the order the forward runs them.
#[derive(Debug, Default, Clone)]
pub struct Census {
    leaves: Option<LeafPredicate>,
    /// The device whose stores the sizes are counted in (`None`: as the module holds them).
    exec: Option<Device>,
    /// The table of a model bound to its checkpoint files: its bound parameters are sized from it, unread.
    files: Option<FileTable>,
    blocks: Vec<CensusBlock>,
    /// Per block list, its number of blocks.
    lists: Vec<usize>,
}

impl Census {
    /// An empty census that cuts leaves with `leaves`.
    pub fn new(leaves: LeafPredicate) -> Self {
        Self { leaves: Some(leaves), ..Self::default() }
    }

    /// An empty census that cuts leaves with `leaves` and counts every size as `exec` holds it (a quantized
    /// tensor in `exec`'s store: [`tensor_bytes_on`](crate::whole::tensor_bytes_on)).
    pub fn on(leaves: LeafPredicate, exec: &Device) -> Self {
        Self { leaves: Some(leaves), exec: Some(exec.clone()), ..Self::default() }
    }

    /// This census with the parameters `files` binds sized from it, none of them read ([`crate::weights`]).
    pub fn with_files(mut self, files: FileTable) -> Self {
        self.files = Some(files);
        self
    }

    /// A block list, in the order the forward runs it, whose blocks' forwards take the leaf at the dotted path
    /// `first` first (`None`: the block's own parameters, its norms).
    pub fn blocks_from<B: Module>(&mut self, blocks: &[B], first: Option<&str>) {
        let leaves = self.leaves.clone().unwrap_or_default();
        self.lists.push(blocks.len());
        self.blocks.extend(blocks.iter().map(|block| {
            let (exec, files) = (self.exec.as_ref(), self.files.as_ref());
            let groups = leaf_groups_with(block, &leaves, exec, files);
            // The path resolves as `leaf!` resolves it: a norm's path to the group its weights travel with.
            let first = crate::paths::leaf_group_of(block, &groups, first.unwrap_or_default()).map(str::to_string);
            CensusBlock { bytes: module_bytes_with(block, exec, files), leaves: groups, first }
        }));
    }

    /// A block list whose blocks' forwards start with their own parameters.
    pub fn blocks<B: Module>(&mut self, blocks: &[B]) {
        self.blocks_from(blocks, None);
    }

    /// A declared sub-model: its own parts, then the rest of it (one streamed group when it holds weights).
    pub fn nested<S: OffloadModel>(&mut self, element: &S) {
        let before = self.blocks.len();
        element.census(self);
        let declared: u64 = self.blocks[before..].iter().map(|b| b.bytes).sum();
        let rest = module_bytes_with(element, self.exec.as_ref(), self.files.as_ref()).saturating_sub(declared);
        if rest > 0 {
            self.lists.push(1);
            self.blocks.push(CensusBlock {
                bytes: rest,
                leaves: vec![(String::new(), rest)],
                first: Some(String::new()),
            });
        }
    }

    /// How many blocks each list has, in order (a nested sub-model's rest counts as a list of one).
    pub fn list_lengths(&self) -> &[usize] {
        &self.lists
    }

    /// How many groups the declared parts make at block level, one block per group.
    pub fn block_groups(&self) -> usize {
        self.blocks.len()
    }
}

/// The planner's layout of `model`, measured from its loaded parameters and its census: each block's bytes in
/// execution order, the bytes outside the blocks, the leaf groups inside the blocks (leaf level keeps the layers
/// outside the blocks resident, as block level does) and the first leaf's bytes. `None` for a model that names no
/// block list.
pub fn measure_layout<M: OffloadModel>(model: &M) -> Option<BlockLayout> {
    layout_of(model, Census::new(M::leaf_types()))
}

/// [`measure_layout`] with every size as `exec` holds it: the layout a planner uses for a model that runs on
/// `exec` (a quantized model's groups hold `exec`'s store).
pub fn measure_layout_on<M: OffloadModel>(model: &M, exec: &Device) -> Option<BlockLayout> {
    layout_of(model, Census::on(M::leaf_types(), exec))
}

/// [`measure_layout_on`] of a model bound to its checkpoint files: every bound parameter is sized from `files`,
/// so the layout of a 12 GB transformer is measured without reading a byte of it.
pub fn measure_layout_with<M: OffloadModel>(
    model: &M,
    exec: Option<&Device>,
    files: &FileTable,
) -> Option<BlockLayout> {
    let census = match exec {
        Some(exec) => Census::on(M::leaf_types(), exec),
        None => Census::new(M::leaf_types()),
    };
    layout_of(model, census.with_files(files.clone()))
}

fn layout_of<M: OffloadModel>(model: &M, mut census: Census) -> Option<BlockLayout> {
    let exec = census.exec.clone();
    let files = census.files.clone();
    model.census(&mut census);
    if census.lists.is_empty() {
        return None;
    }
    let block_bytes: Vec<u64> = census.blocks.iter().map(|block| block.bytes).collect();
    let leaves = census.blocks.iter().flat_map(|block| &block.leaves);
    let largest_leaf_bytes = leaves.clone().map(|(_, bytes)| *bytes).max().unwrap_or(0);
    let first_leaf_bytes = census
        .blocks
        .iter()
        .find_map(|block| block.leaves.iter().find(|(path, _)| Some(path) == block.first.as_ref()).map(|(_, b)| *b))
        .unwrap_or(0);
    Some(BlockLayout {
        outside_bytes: module_bytes_with(model, exec.as_ref(), files.as_ref()).saturating_sub(block_bytes.iter().sum()),
        block_bytes,
        largest_leaf_bytes,
        leaf_count: leaves.clone().count(),
        first_leaf_bytes,
        leaf_bytes: leaves.map(|(_, bytes)| *bytes).collect(),
    })
}

/// What [`check_streaming`] ran and found.
///
/// Both levels count groups by one rule: a group is counted when it holds weights, and the model's shell (the
/// layers outside the declared parts, which stay resident by default) is not. A nested sub-model's rest counts
/// when it holds weights, at both levels; a rest that holds none (a stage with only its blocks) counts at
/// neither. The census ([`OffloadModel::census`], [`measure_layout`]) counts by the same rule, and the check
/// fails when the two disagree.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamingCheck {
    /// Groups at block level, one block per group: each block, each single block, and each nested sub-model's
    /// rest that holds weights (the census's blocks that hold weights: [`BlockLayout::block_bytes`]).
    pub block_groups: usize,
    /// Groups at leaf level: each leaf, each block's own group (its norms), and each nested sub-model's rest that
    /// holds weights (the census's leaves that hold weights: [`BlockLayout::leaf_count`]).
    pub leaf_groups: usize,
    /// The largest difference of a streamed output from the resident one, relative to the largest resident value.
    pub max_relative_difference: f32,
}

/// The test every [`OffloadModel`] gets for free: runs `forward` on the resident model, then twice (the capture,
/// then prefetched, each as one [`GroupOffload::run`]) under block-level and under leaf-level group offload on
/// `device`, and checks that
///
/// - every streamed output equals the resident one (within 1e-4 of the largest value);
/// - no parameter was loaded outside the group that holds it (no stray loads), and every path named a group;
/// - every group that holds weights was taken;
/// - the second forward found every group prefetched (no miss) and followed the captured order (no new step);
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
        let mut after_capture = None;
        for _ in 0..2 {
            let out = offload.run(|| forward(M::streamed(&parts)).map_err(|e| failed(name, e.to_string())))?;
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
            offload.wait_idle();
            after_capture.get_or_insert(offload.stats());
        }
        let stats = offload.stats();
        if stats.stray_loads > 0 {
            return Err(failed(
                name,
                format!(
                    "{} parameter(s) were loaded outside their group (first: {}); the forward used a weight through a part that does not hold it: take each leaf by its own field path with leaf!, narrowing to a module of several leaves with narrow! (to an optional one with narrow!(block, field).some()), never through Layer::whole or another leaf's part",
                    stats.stray_loads,
                    offload.stray_parameters().first().cloned().unwrap_or_default()
                ),
            ));
        }
        if let Some(first) = after_capture {
            let (misses, inserts) = (stats.misses - first.misses, stats.order_inserts - first.order_inserts);
            if misses > 0 || inserts > 0 {
                return Err(failed(
                    name,
                    format!(
                        "the second forward missed {misses} prefetch(es) and learnt {inserts} new step(s); the forward takes its groups in a different order each time (a part chosen by data?), so the captured order does not hold"
                    ),
                ));
            }
        }
        let order = offload.order();
        let groups = offload.groups();
        if let Some((never, _)) = groups.iter().find(|(id, bytes)| *bytes > 0 && !order.contains(id)) {
            return Err(failed(
                name,
                format!(
                    "group {never} was never taken; the forward skips its weights, or reaches them under another path"
                ),
            ));
        }
        // One rule at both levels (see `StreamingCheck`): groups that hold weights, the shell left out.
        let shell = format!("{}/shell", M::CLASS);
        let made = groups.iter().filter(|(id, bytes)| *bytes > 0 && *id != shell).count();
        let (named, unit) = match options.level {
            GroupLevel::Block { .. } => {
                check.block_groups = made;
                (census.blocks.iter().filter(|block| block.bytes > 0).count(), "block")
            }
            GroupLevel::Leaf => {
                check.leaf_groups = made;
                (census.blocks.iter().flat_map(|block| &block.leaves).filter(|(_, bytes)| *bytes > 0).count(), "leaf")
            }
        };
        if named != made {
            return Err(failed(
                name,
                format!(
                    "the census names {named} {unit} groups but the split made {made}; name the same parts in census and split"
                ),
            ));
        }
    }
    Ok(check)
}
