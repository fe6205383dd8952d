//! The weights as a forward reads them: the views `#[derive(OffloadModel)]` puts in a model's
//! [`Weights`](crate::OffloadModel::Weights), the same types whether the weights are resident or streamed.
//!
//! - [`Blocks`]: a block list, by index ([`Blocks::get`]), length, iteration ([`Blocks::iter`], with
//!   `.enumerate()`) or fold ([`Blocks::fold`]); each block is a [`Layer`].
//! - [`Single`]: one module that is a group of its own (a final layer); [`Single::get`] is its [`Layer`].
//! - [`Nested`]: a list of declared sub-models (a UNet's `down_blocks`), each element its own weights view.
//! - [`Shell`]: the layers outside the declared parts.
//! - [`Layer`]: one block's weights, taken whole (resident, or its block group on the device) or leaf by leaf
//!   (leaf level). [`leaf!`](crate::leaf) takes a leaf by its field path, [`narrow!`](crate::narrow) narrows the
//!   layer to a sub-module, so one sub-module forward serves every block that holds one.
//!
//! A guard keeps a group on the device while a [`Layer`] or [`Part`] of it lives: drop it (end the statement, or
//! the block's forward) before taking the next, or the ring bound grows by one group per one held.

use std::ops::Deref;
use std::rc::Rc;

use burn::module::Module;

use crate::error::{Error, Result};
use crate::model::{OffloadModel, Streamed, StreamedOne};
use crate::parts::{BlockOffload, GroupGuard, LeafOffload, ModuleOffload};
use crate::paths::{Found, under};

/// One segment of a leaf's field path: a field name, or an index into a `Vec` field. Written by
/// [`leaf!`](crate::leaf) and [`narrow!`](crate::narrow); a path is joined into a string only at leaf level.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seg<'s> {
    /// A field.
    Field(&'s str),
    /// An element of a `Vec` field.
    Index(usize),
}

/// `segments` joined with dots, as burn names the parameters (`attention.to_out.0`).
fn dotted(segments: &[Seg<'_>]) -> String {
    let mut out = String::new();
    for segment in segments {
        if !out.is_empty() {
            out.push('.');
        }
        match segment {
            Seg::Field(name) => out.push_str(name),
            Seg::Index(index) => out.push_str(&index.to_string()),
        }
    }
    out
}

/// One part of a model's weights, dereferencing to the module (only the part's own weights are guaranteed on the
/// device under leaf-level offload).
pub enum Part<'a, M> {
    /// The whole module, where it runs.
    Whole(&'a M),
    /// A group's guard: the group stays on the device while it lives.
    Guard(GroupGuard<'a, M>),
    /// A part of a narrowed layer: the guard of the enclosing module's group, seen through the narrowing.
    Narrowed(Box<dyn Deref<Target = M> + 'a>),
}

impl<M> Deref for Part<'_, M> {
    type Target = M;

    fn deref(&self) -> &M {
        match self {
            Part::Whole(module) => module,
            Part::Guard(guard) => guard,
            Part::Narrowed(part) => part,
        }
    }
}

/// A module whose weights are on the device as long as the holder lives (a block group's guard).
trait Hold<M> {
    fn module(&self) -> &M;
}

/// Block `index` of a block group, sharing the group's guard with the group's other blocks.
struct HeldBlock<'a, B> {
    guard: Rc<GroupGuard<'a, Vec<B>>>,
    index: usize,
}

impl<B> Hold<B> for HeldBlock<'_, B> {
    fn module(&self) -> &B {
        &self.guard[self.index]
    }
}

/// A module that is one group, held.
struct HeldOne<'a, B>(GroupGuard<'a, B>);

impl<B> Hold<B> for HeldOne<'_, B> {
    fn module(&self) -> &B {
        &self.0
    }
}

/// Where a leaf-level layer takes its parts.
trait LeafSource<M> {
    /// The leaf at `path` inside the layer, by [`leaf!`](crate::leaf)'s rules ([`Layer::part_at`]).
    fn leaf(&self, path: &str) -> Result<Part<'_, M>>;
    /// The group at exactly `path` (`""`: the layer's own parameters), `None` when the layer has none there.
    fn group_at(&self, path: &str) -> Option<Result<Part<'_, M>>>;
    /// The layer with no group taken: its structure, every weight a placeholder that loads itself when read.
    fn bare(&self) -> Part<'_, M>;
    /// The layer's skeleton, for its non-weight fields.
    fn structure(&self) -> &M;
}

impl<M: Module> LeafSource<M> for &LeafOffload<M> {
    fn leaf(&self, path: &str) -> Result<Part<'_, M>> {
        let groups = self.group_paths();
        let inside: Vec<&str> = groups.iter().copied().filter(|group| under(group, path)).collect();
        // A module of several leaves is refused below even when it has a group of its own (its norm): handing out
        // only that group would leave its leaves to load as strays.
        if inside.is_empty()
            && let Some(part) = self.group_at(path)
        {
            return part;
        }
        if path.is_empty() {
            // The layer has no parameters of its own: `own()`'s case.
            return Ok(self.bare());
        }
        let found = Found::at(self.skeleton(), path);
        let problem = if !inside.is_empty() {
            let listed = inside.iter().map(|g| format!("{g:?}")).collect::<Vec<_>>().join(", ");
            let field = field_syntax(path);
            format!(
                "it is a module of the leaf groups {listed}, not one leaf; narrow to it with narrow!(block, {field}) \
                 (an optional one with narrow!(block, {field}).some()) and take each of its leaves with leaf! and \
                 its own parameters (a norm) with own()"
            )
        } else if found.weights {
            // Parameters under no leaf of their own (a norm's) travel with the deepest enclosing group: hand that
            // group out, the one `own()` takes on the struct that holds them.
            let holder =
                groups.iter().copied().filter(|group| group.is_empty() || under(path, group)).max_by_key(|g| g.len());
            match holder {
                Some(holder) => return Ok(Part::Guard(self.group(holder)?)),
                None => "its parameters are in no group of the block; report this as a bug".to_string(),
            }
        } else if found.module {
            // A field that holds no weights (an optional layer that is `None` here, a layer without parameters):
            // nothing to take, and reading it through the bare layer gives what the block holds.
            return Ok(self.bare());
        } else {
            let listed = groups
                .iter()
                .map(|g| if g.is_empty() { "\"\" (its own parameters)".to_string() } else { format!("{g:?}") })
                .collect::<Vec<_>>()
                .join(", ");
            format!(
                "no module field of the block has this path; take a leaf by its field with leaf!(block, field), \
                 which the compiler checks, read a non-weight field with structure(), or name one of its leaf \
                 groups: {listed}"
            )
        };
        let (model, block) = self.names();
        Err(Error::NoLeaf { model: model.to_string(), block: block.to_string(), path: path.to_string(), problem })
    }

    fn group_at(&self, path: &str) -> Option<Result<Part<'_, M>>> {
        let exists = self.group_paths().contains(&path);
        exists.then(|| self.group(path).map(Part::Guard))
    }

    fn bare(&self) -> Part<'_, M> {
        Part::Guard(LeafOffload::bare(self))
    }

    fn structure(&self) -> &M {
        self.skeleton()
    }
}

/// A dotted path as the field path `leaf!` and `narrow!` take (`resnets.0.conv1` as `resnets[0].conv1`).
fn field_syntax(path: &str) -> String {
    let mut out = String::new();
    for segment in path.split('.') {
        if segment.parse::<usize>().is_ok() {
            out.push_str(&format!("[{segment}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(segment);
        }
    }
    out
}

/// A leaf-level layer narrowed to the sub-module at `prefix` of its parent.
struct NarrowedLeaves<'a, P, N, F> {
    parent: Rc<dyn LeafSource<P> + 'a>,
    prefix: String,
    select: F,
    narrowed: std::marker::PhantomData<fn() -> N>,
}

/// A part of the parent seen through the narrowing.
struct Projected<'p, P, F> {
    part: Part<'p, P>,
    select: &'p F,
}

impl<P, N, F: Fn(&P) -> &N> Deref for Projected<'_, P, F> {
    type Target = N;

    fn deref(&self) -> &N {
        (self.select)(&self.part)
    }
}

impl<'a, P: 'a, N: 'a, F: Fn(&P) -> &N + 'a> NarrowedLeaves<'a, P, N, F> {
    /// `path` inside the narrowed module as a path inside the parent.
    fn full(&self, path: &str) -> String {
        match (self.prefix.is_empty(), path.is_empty()) {
            (true, _) => path.to_string(),
            (false, true) => self.prefix.clone(),
            (false, false) => format!("{}.{path}", self.prefix),
        }
    }

    fn project<'s>(&'s self, part: Part<'s, P>) -> Part<'s, N> {
        Part::Narrowed(Box::new(Projected { part, select: &self.select }))
    }
}

impl<'a, P: 'a, N: 'a, F: Fn(&P) -> &N + 'a> LeafSource<N> for NarrowedLeaves<'a, P, N, F> {
    fn leaf(&self, path: &str) -> Result<Part<'_, N>> {
        Ok(self.project(self.parent.leaf(&self.full(path))?))
    }

    fn group_at(&self, path: &str) -> Option<Result<Part<'_, N>>> {
        Some(self.parent.group_at(&self.full(path))?.map(|part| self.project(part)))
    }

    fn bare(&self) -> Part<'_, N> {
        self.project(self.parent.bare())
    }

    fn structure(&self) -> &N {
        (self.select)(self.parent.structure())
    }
}

enum Source<'a, M> {
    Whole(&'a M),
    Held(Rc<dyn Hold<M> + 'a>),
    Leaves(Rc<dyn LeafSource<M> + 'a>),
}

/// One layer's weights during one forward: a block of a [`Blocks`] list, a [`Single`], or a sub-module of either
/// ([`narrow!`](crate::narrow)). Resident, or taken as a block group, it is the whole module; at leaf level each part is
/// taken from its leaf group when the forward asks for it ([`leaf!`](crate::leaf), [`Layer::own`]).
///
/// Cloning is cheap and shares the held group.
pub struct Layer<'a, M> {
    source: Source<'a, M>,
}

impl<M> Clone for Layer<'_, M> {
    fn clone(&self) -> Self {
        let source = match &self.source {
            Source::Whole(module) => Source::Whole(*module),
            Source::Held(held) => Source::Held(held.clone()),
            Source::Leaves(leaves) => Source::Leaves(leaves.clone()),
        };
        Self { source }
    }
}

impl<'a, M: Module + 'a> Layer<'a, M> {
    /// A layer whose weights are all where it runs: a resident module, or one you hold yourself.
    pub fn whole(module: &'a M) -> Self {
        Self { source: Source::Whole(module) }
    }

    fn leaves(leaves: &'a LeafOffload<M>) -> Self {
        Self { source: Source::Leaves(Rc::new(leaves)) }
    }

    /// The part at a path of segments (what [`leaf!`](crate::leaf) writes): the whole layer, or at leaf level a
    /// guard holding the leaf group at that path on the device while it lives. The path is joined into a
    /// string only at leaf level, so the resident forward builds none. At leaf level a path that holds no weights
    /// (an optional layer that is `None` in this block) takes no group, and a path whose weights are under no
    /// leaf of their own (a norm) takes the group they travel with, so the part is the same at every level.
    #[doc(hidden)]
    pub fn part_at(&self, path: &[Seg<'_>]) -> Result<Part<'_, M>> {
        match &self.source {
            Source::Whole(module) => Ok(Part::Whole(module)),
            Source::Held(held) => Ok(Part::Whole(held.module())),
            Source::Leaves(leaves) => leaves.leaf(&dotted(path)),
        }
    }

    /// The part at a dotted path written by hand (`"attention.to_q"`), as [`part_at`](Self::part_at) takes it:
    /// [`leaf!`](crate::leaf) writes the same from the field path, checked by the compiler; a path written here is
    /// checked only at leaf level, so by [`check_streaming`](crate::check_streaming): a path that names no field
    /// of the block, or a module of several leaves, is [`Error::NoLeaf`] naming the block, the path and the fix.
    pub fn part(&self, path: &str) -> Result<Part<'_, M>> {
        match &self.source {
            Source::Whole(module) => Ok(Part::Whole(module)),
            Source::Held(held) => Ok(Part::Whole(held.module())),
            Source::Leaves(leaves) => leaves.leaf(path),
        }
    }

    /// The layer's own parameters, those under no leaf (a block's norms, which travel with the block at leaf
    /// level): the whole layer, or the group holding them. A layer with no parameters of its own hands out its
    /// structure with every weight left where it is, so a weight read through it is a stray load that
    /// [`check_streaming`](crate::check_streaming) reports.
    pub fn own(&self) -> Result<Part<'_, M>> {
        match &self.source {
            Source::Whole(module) => Ok(Part::Whole(module)),
            Source::Held(held) => Ok(Part::Whole(held.module())),
            Source::Leaves(leaves) => leaves.group_at("").unwrap_or_else(|| Ok(leaves.bare())),
        }
    }

    /// The layer narrowed to its sub-module at `path` (what [`narrow!`](crate::narrow) writes), reached by
    /// `select`: one forward of the sub-module serves every layer that holds one.
    #[doc(hidden)]
    pub fn narrow_at<N: Module + 'a, F>(&self, path: &[Seg<'_>], select: F) -> Layer<'_, N>
    where
        F: for<'m> Fn(&'m M) -> &'m N + 'a,
    {
        match &self.source {
            Source::Whole(module) => Layer { source: Source::Whole(select(module)) },
            Source::Held(held) => Layer { source: Source::Whole(select(held.module())) },
            Source::Leaves(leaves) => {
                let narrowed = NarrowedLeaves {
                    parent: leaves.clone(),
                    prefix: dotted(path),
                    select,
                    narrowed: std::marker::PhantomData::<fn() -> N>,
                };
                Layer { source: Source::Leaves(Rc::new(narrowed)) }
            }
        }
    }

    /// The layer's structure, for its non-weight fields (a head count, whether an optional sub-layer exists, a
    /// list's length), read without taking any group. Read no weight through it: at leaf level its weights are
    /// placeholders.
    pub fn structure(&self) -> &M {
        match &self.source {
            Source::Whole(module) => module,
            Source::Held(held) => held.module(),
            Source::Leaves(leaves) => leaves.structure(),
        }
    }

    /// Whether the layer's weights are taken leaf by leaf (leaf level).
    pub fn is_leaf_level(&self) -> bool {
        matches!(self.source, Source::Leaves(_))
    }
}

impl<'a, N: Module + 'a> Layer<'a, Option<N>> {
    /// The optional module as a layer of its own: `None` where this block has none, the module's layer where
    /// it has one, at every level (read from the structure, taking no group). It is how a forward reaches an
    /// optional module of several leaves, a cross-attention present in some blocks only:
    ///
    /// ```
    /// use burn::module::Module;
    /// use burn::nn::{Linear, LinearConfig};
    /// use burn::tensor::{Device, Tensor};
    /// use group_offload::prelude::*;
    ///
    /// #[derive(Module, Debug)]
    /// struct Cross { q: Linear, o: Linear }
    /// #[derive(Module, Debug)]
    /// struct Block { fc: Linear, cross: Option<Cross> }
    ///
    /// fn block(block: &Layer<'_, Block>, x: Tensor<2>) -> Result<Tensor<2>> {
    ///     let mut x = leaf!(block, fc).forward(x);
    ///     if let Some(cross) = narrow!(block, cross).some() {
    ///         x = leaf!(cross, o).forward(leaf!(cross, q).forward(x));
    ///     }
    ///     Ok(x)
    /// }
    ///
    /// let device = Device::flex();
    /// let linear = || LinearConfig::new(4, 4).init(&device);
    /// let with = Block { fc: linear(), cross: Some(Cross { q: linear(), o: linear() }) };
    /// let without = Block { fc: linear(), cross: None };
    /// for b in [with, without] {
    ///     assert_eq!(block(&Layer::whole(&b), Tensor::<2>::ones([1, 4], &device))?.dims(), [1, 4]);
    /// }
    /// # Ok::<(), group_offload::Error>(())
    /// ```
    pub fn some(self) -> Option<Layer<'a, N>> {
        let source = match self.source {
            Source::Whole(module) => Source::Whole(module.as_ref()?),
            Source::Held(held) => {
                held.module().as_ref()?;
                Source::Held(Rc::new(HeldSome(held)))
            }
            Source::Leaves(leaves) => {
                leaves.structure().as_ref()?;
                // `Option` adds no segment to burn's parameter paths: the module's leaves are at the same paths.
                let narrowed = NarrowedLeaves {
                    parent: leaves,
                    prefix: String::new(),
                    select: present::<N>,
                    narrowed: std::marker::PhantomData::<fn() -> N>,
                };
                Source::Leaves(Rc::new(narrowed))
            }
        };
        Some(Layer { source })
    }
}

/// The module inside an optional module that [`Layer::some`] found present.
fn present<N>(module: &Option<N>) -> &N {
    match module {
        Some(module) => module,
        // Every part of a layer is installed from one structure, whose option `some` checked before it made the
        // layer; no part of it can be `None`.
        None => unreachable!("an optional module found present in a layer's structure is absent in one of its parts"),
    }
}

/// A held optional module that [`Layer::some`] found present.
struct HeldSome<'a, N>(Rc<dyn Hold<Option<N>> + 'a>);

impl<N> Hold<N> for HeldSome<'_, N> {
    fn module(&self) -> &N {
        present(self.0.module())
    }
}

/// A block list as the forward reads it: resident, or streamed. `#[offload(blocks)]` on a `Vec<B>` field.
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

impl<'a, B: Module + 'a> Blocks<'a, B> {
    /// How many blocks the list has, known at every level without taking a group.
    pub fn len(self) -> usize {
        match self {
            Blocks::Resident(blocks) => blocks.len(),
            Blocks::Streamed(Streamed::Blocks(blocks)) => blocks.num_blocks(),
            Blocks::Streamed(Streamed::Leaves(blocks)) => blocks.len(),
        }
    }

    /// Whether the list is empty.
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    /// Block `index` (`None` past the end): at block level its group is taken (on the device while the layer
    /// lives). To walk the list, [`iter`](Self::iter) takes each group once for all its blocks.
    pub fn get(self, index: usize) -> Option<Result<Layer<'a, B>>> {
        match self {
            Blocks::Resident(blocks) => blocks.get(index).map(|b| Ok(Layer::whole(b))),
            Blocks::Streamed(Streamed::Blocks(blocks)) => {
                let group = (0..blocks.num_groups()).find(|k| blocks.blocks_of(*k).contains(&index))?;
                Some(held_block(blocks, group, index))
            }
            Blocks::Streamed(Streamed::Leaves(blocks)) => blocks.get(index).map(|b| Ok(Layer::leaves(b))),
        }
    }

    /// Every block in order, each group taken once as the iterator reaches it and released when its last
    /// block's layer is dropped. `.enumerate()` gives the index.
    pub fn iter(self) -> BlockIter<'a, B> {
        BlockIter { blocks: self, next: 0, group: None }
    }

    /// Runs `step` over every block in order, threading `state` through (a skip connection, the hidden
    /// state): `blocks.fold(x, |block, x| Ok(x + leaf!(block, fc).forward(x)))`.
    pub fn fold<T>(self, state: T, step: impl FnMut(Layer<'a, B>, T) -> Result<T>) -> Result<T> {
        self.try_fold(state, step)
    }

    /// [`fold`](Self::fold) for a step with an error type of its own (`From<group_offload::Error>`).
    pub fn try_fold<T, E: From<crate::Error>>(
        self,
        mut state: T,
        mut step: impl FnMut(Layer<'a, B>, T) -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        for block in self.iter() {
            state = step(block?, state)?;
        }
        Ok(state)
    }
}

fn held_block<'a, B: Module>(blocks: &'a BlockOffload<B>, group: usize, index: usize) -> Result<Layer<'a, B>> {
    let guard = Rc::new(blocks.group(group)?);
    let offset = index - blocks.blocks_of(group).start;
    Ok(Layer { source: Source::Held(Rc::new(HeldBlock { guard, index: offset })) })
}

/// The blocks of a [`Blocks`] list in order ([`Blocks::iter`]).
pub struct BlockIter<'a, B> {
    blocks: Blocks<'a, B>,
    next: usize,
    /// The block group taken for the blocks it holds.
    group: Option<HeldGroup<'a, B>>,
}

/// A block group a [`BlockIter`] holds: its number, its first block and its guard.
type HeldGroup<'a, B> = (usize, usize, Rc<GroupGuard<'a, Vec<B>>>);

impl<'a, B: Module + 'a> Iterator for BlockIter<'a, B> {
    type Item = Result<Layer<'a, B>>;

    fn next(&mut self) -> Option<Self::Item> {
        let index = self.next;
        if index >= self.blocks.len() {
            self.group = None;
            return None;
        }
        self.next += 1;
        let Blocks::Streamed(Streamed::Blocks(blocks)) = self.blocks else {
            return self.blocks.get(index);
        };
        let held = self.group.as_ref().filter(|(k, _, _)| blocks.blocks_of(*k).contains(&index));
        let (start, guard) = match held {
            Some((_, start, guard)) => (*start, guard.clone()),
            None => {
                // Release the previous group before taking the next, so the ring bound holds.
                self.group = None;
                let k = (0..blocks.num_groups()).find(|k| blocks.blocks_of(*k).contains(&index))?;
                let guard = match blocks.group(k) {
                    Ok(guard) => Rc::new(guard),
                    Err(error) => return Some(Err(error)),
                };
                let start = blocks.blocks_of(k).start;
                self.group = Some((k, start, guard.clone()));
                (start, guard)
            }
        };
        Some(Ok(Layer { source: Source::Held(Rc::new(HeldBlock { guard, index: index - start })) }))
    }
}

/// One module that is a group of its own, as the forward reads it: `#[offload(block)]` on a field that is not a
/// `Vec` (a final layer, a mid block's attention).
pub enum Single<'a, B> {
    /// The module, where it runs.
    Resident(&'a B),
    /// The module under group offload.
    Streamed(&'a StreamedOne<B>),
}

impl<B> Clone for Single<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Single<'_, B> {}

impl<'a, B: Module + 'a> Single<'a, B> {
    /// The module as a [`Layer`]: at block level its group is taken and stays on the device while the layer
    /// lives.
    pub fn get(self) -> Result<Layer<'a, B>> {
        match self {
            Single::Resident(module) => Ok(Layer::whole(module)),
            Single::Streamed(StreamedOne::Group(group)) => {
                Ok(Layer { source: Source::Held(Rc::new(HeldOne(group.get()?))) })
            }
            Single::Streamed(StreamedOne::Leaves(leaves)) => Ok(Layer::leaves(leaves)),
        }
    }
}

/// A list of declared sub-models as the forward reads it: `#[offload(nested)]` on a `Vec<S>` field whose `S`
/// derives [`OffloadModel`] (a UNet's `down_blocks`, each holding its own `resnets`). Each element is its own
/// weights view.
pub enum Nested<'a, S: OffloadModel> {
    /// The elements, resident.
    Resident(&'a [S]),
    /// The elements taken apart.
    Streamed(&'a [S::Parts]),
}

impl<S: OffloadModel> Clone for Nested<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S: OffloadModel> Copy for Nested<'_, S> {}

impl<'a, S: OffloadModel> Nested<'a, S> {
    /// How many elements the list has.
    pub fn len(self) -> usize {
        match self {
            Nested::Resident(elements) => elements.len(),
            Nested::Streamed(elements) => elements.len(),
        }
    }

    /// Whether the list is empty.
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    /// Element `index`'s weights (`None` past the end). Taking the view takes no group.
    pub fn get(self, index: usize) -> Option<S::Weights<'a>> {
        match self {
            Nested::Resident(elements) => elements.get(index).map(S::weights),
            Nested::Streamed(elements) => elements.get(index).map(S::streamed),
        }
    }

    /// Every element's weights, in order.
    pub fn iter(self) -> impl Iterator<Item = S::Weights<'a>> + 'a {
        (0..self.len()).filter_map(move |i| self.get(i))
    }
}

/// The layers outside the declared parts as the forward reads them: the resident model, or its shell under
/// offload (resident on the device by default, or streamed as one group).
pub enum Shell<'a, M> {
    /// The model itself (its declared parts are there too, unused by the shell's calls).
    Resident(&'a M),
    /// The shell part.
    Streamed(&'a ModuleOffload<M>),
}

impl<M> Clone for Shell<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M> Copy for Shell<'_, M> {}

impl<'a, M: Module> Shell<'a, M> {
    /// The shell's weights on the device while the returned part lives. Take it as often as the forward needs
    /// (a UNet takes its time embedding before the down path and its output layers after the up path): the
    /// capture records every take.
    pub fn get(self) -> Result<Part<'a, M>> {
        match self {
            Shell::Resident(model) => Ok(Part::Whole(model)),
            Shell::Streamed(shell) => Ok(Part::Guard(shell.get()?)),
        }
    }

    /// The model's structure, for its non-weight fields (a config), read without taking the group. Read no
    /// weight through it: under offload its weights are placeholders, and its declared parts are empty or
    /// hollow (zero-sized).
    pub fn structure(self) -> &'a M {
        match self {
            Shell::Resident(model) => model,
            Shell::Streamed(shell) => shell.skeleton(),
        }
    }
}

/// Takes the leaf at a field path of a [`Layer`] and evaluates to that field: `leaf!(block, attention.to_q)`,
/// `leaf!(block, attention.to_out[0])`, `leaf!(stage, resnets[j].conv1)`. The group's path and the field it names
/// are the same tokens, so renaming the field is a compile error here rather than a path left behind. Use it
/// inside a function whose error type is `From<group_offload::Error>`; the part stays on the device until the
/// end of the statement. An index is evaluated twice: pass a variable or a literal.
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use group_offload::prelude::*;
///
/// #[derive(Module, Debug)]
/// struct Mlp { up: Linear, down: Vec<Linear> }
///
/// fn forward(mlp: &Layer<'_, Mlp>, x: Tensor<2>) -> Result<Tensor<2>> {
///     let h = leaf!(mlp, up).forward(x);
///     Ok(leaf!(mlp, down[0]).forward(h))
/// }
///
/// let device = Device::flex();
/// let mlp = Mlp { up: LinearConfig::new(4, 8).init(&device), down: vec![LinearConfig::new(8, 4).init(&device)] };
/// assert_eq!(forward(&Layer::whole(&mlp), Tensor::<2>::ones([1, 4], &device))?.dims(), [1, 4]);
/// # Ok::<(), group_offload::Error>(())
/// ```
///
/// The part is the same at every level. A field that holds no weights in this block (an optional layer that is
/// `None`) takes no group, so `match &leaf!(block, skip) { Some(skip) => .., None => .. }` works at leaf level
/// too; a field whose weights are under no leaf of their own (a norm) takes the group they travel with, the one
/// [`Layer::own`] takes on the struct that holds them. A module of several leaves (`leaf!(block, attention)`)
/// is no one leaf: at leaf level it is [`Error::NoLeaf`](crate::Error::NoLeaf); narrow to it with
/// [`narrow!`](crate::narrow) and take each of its leaves.
#[macro_export]
macro_rules! leaf {
    ($layer:expr, $first:ident $($rest:tt)*) => {
        $crate::__path!(@part $layer; [$crate::view::Seg::Field(::core::stringify!($first)),]; [.$first]; $($rest)*)
    };
}

/// Narrows a [`Layer`] to the sub-module at a field path: `narrow!(block, attention)` is a
/// `Layer<'_, Attention>`, so one attention forward serves every block that holds one, at every level.
/// `narrow!(stage, resnets[j])` narrows to an element of a `Vec` field.
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use group_offload::prelude::*;
///
/// #[derive(Module, Debug)]
/// struct Mlp { fc: Linear }
/// #[derive(Module, Debug)]
/// struct Block { mlp: Mlp }
///
/// fn mlp(mlp: &Layer<'_, Mlp>, x: Tensor<2>) -> Result<Tensor<2>> {
///     Ok(leaf!(mlp, fc).forward(x))
/// }
///
/// let device = Device::flex();
/// let block = Block { mlp: Mlp { fc: LinearConfig::new(4, 4).init(&device) } };
/// let layer = Layer::whole(&block);
/// assert_eq!(mlp(&narrow!(layer, mlp), Tensor::<2>::ones([1, 4], &device))?.dims(), [1, 4]);
/// # Ok::<(), group_offload::Error>(())
/// ```
#[macro_export]
macro_rules! narrow {
    ($layer:expr, $first:ident $($rest:tt)*) => {
        $crate::__path!(@narrow $layer; [$crate::view::Seg::Field(::core::stringify!($first)),]; [.$first]; $($rest)*)
    };
}

/// The muncher behind [`leaf!`] and [`narrow!`]: the path's segments and its field access, from one token
/// sequence.
#[doc(hidden)]
#[macro_export]
macro_rules! __path {
    (@$mode:ident $layer:expr; [$($seg:expr,)*]; [$($access:tt)*]; . $field:ident $($rest:tt)*) => {
        $crate::__path!(@$mode $layer; [$($seg,)* $crate::view::Seg::Field(::core::stringify!($field)),];
            [$($access)* .$field]; $($rest)*)
    };
    (@$mode:ident $layer:expr; [$($seg:expr,)*]; [$($access:tt)*]; [$index:expr] $($rest:tt)*) => {
        $crate::__path!(@$mode $layer; [$($seg,)* $crate::view::Seg::Index($index),]; [$($access)* [$index]];
            $($rest)*)
    };
    (@part $layer:expr; [$($seg:expr,)*]; [$($access:tt)*];) => {
        $layer.part_at(&[$($seg),*])? $($access)*
    };
    (@narrow $layer:expr; [$($seg:expr,)*]; [$($access:tt)*];) => {
        $layer.narrow_at(&[$($seg),*], move |module| &module $($access)*)
    };
}
