//! The model author's API as a stranger meets it: the guide's pattern for an optional layer works at both levels,
//! a path that is no leaf is an error naming the block, the path and the fix, and groups are counted by one rule
//! at both levels.

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::{Device, Distribution, Tensor};
use group_offload::model::measure_layout;
use group_offload::prelude::*;

#[derive(Module, Debug)]
struct Mlp {
    up: Linear,
    down: Linear,
}

/// A block whose skip projection (one leaf) and cross-attention (several leaves and a norm) exist in some
/// blocks only.
#[derive(Module, Debug)]
struct SkipBlock {
    mlp: Mlp,
    skip: Option<Linear>,
    cross: Option<Cross>,
    norm: LayerNorm,
}

#[derive(Module, Debug)]
struct Cross {
    norm: LayerNorm,
    q: Linear,
    o: Linear,
}

#[derive(Module, Debug, OffloadModel)]
struct Skips {
    embed: Linear,
    #[offload(blocks)]
    blocks: Vec<SkipBlock>,
}

/// How a block's forward reaches its norm and its MLP, to try the ways a stranger writes it.
#[derive(Clone, Copy)]
enum Reach {
    /// The guide's way: the MLP narrowed, its leaves by field, the norm through `own()`.
    Guide,
    /// The norm by its field, as if it were a leaf: `leaf!(block, norm)`.
    NormByField,
    /// The whole MLP by its field, as if it were one leaf: `leaf!(block, mlp)`.
    MlpByField,
    /// The optional cross-attention by its field, as if it were one leaf: `leaf!(block, cross)`.
    CrossByField,
}

impl SkipsWeights<'_> {
    fn forward(self, x: Tensor<2>, reach: Reach) -> Result<Tensor<2>> {
        let x = self.shell.get()?.embed.forward(x);
        self.blocks.fold(x, |block, x| skip_block(&block, x, reach))
    }
}

fn skip_block(block: &Layer<'_, SkipBlock>, x: Tensor<2>, reach: Reach) -> Result<Tensor<2>> {
    // The guide's pattern for an optional layer: `None` in a block without one, at every level.
    let x = match &leaf!(block, skip) {
        Some(skip) => x.clone() + skip.forward(x),
        None => x,
    };
    let x = match reach {
        Reach::CrossByField => match &leaf!(block, cross) {
            Some(cross) => cross.o.forward(cross.q.forward(cross.norm.forward(x.clone()))) + x,
            None => x,
        },
        // An optional module of several leaves: narrowed, then `some()`, `None` in a block without one.
        _ => match narrow!(block, cross).some() {
            Some(cross) => leaf!(cross, o).forward(leaf!(cross, q).forward(cross.own()?.norm.forward(x.clone()))) + x,
            None => x,
        },
    };
    let h = match reach {
        Reach::MlpByField => {
            let mlp = &leaf!(block, mlp);
            mlp.down.forward(mlp.up.forward(x.clone()))
        }
        Reach::Guide | Reach::NormByField | Reach::CrossByField => {
            let mlp = narrow!(block, mlp);
            leaf!(mlp, down).forward(leaf!(mlp, up).forward(x.clone()))
        }
    };
    Ok(match reach {
        Reach::NormByField => leaf!(block, norm).forward(x + h),
        Reach::Guide | Reach::MlpByField | Reach::CrossByField => block.own()?.norm.forward(x + h),
    })
}

fn skips(device: &Device) -> Skips {
    let linear = || LinearConfig::new(8, 8).init(device);
    let norm = || LayerNormConfig::new(8).init(device);
    let block = |skip: bool, cross: bool| SkipBlock {
        mlp: Mlp { up: linear(), down: linear() },
        skip: skip.then(linear),
        cross: cross.then(|| Cross { norm: norm(), q: linear(), o: linear() }),
        norm: norm(),
    };
    let blocks = vec![block(true, false), block(false, true), block(true, true), block(false, false)];
    Skips { embed: linear(), blocks }
}

fn input(device: &Device) -> Tensor<2> {
    Tensor::random([2, 8], Distribution::Normal(0.0, 1.0), device)
}

#[test]
fn an_optional_layer_that_is_none_in_some_blocks_streams_at_both_levels() {
    let device = Device::flex();
    let (model, x) = (skips(&device), input(&device));
    let check = check_streaming(model, &device, |weights| weights.forward(x.clone(), Reach::Guide))
        .expect("the guide's pattern for an optional layer streams at both levels");
    assert_eq!(check.block_groups, 4, "{check:?}");
    // Per block: mlp.up, mlp.down, the norm's group, the skip where there is one (2 blocks), and the
    // cross-attention's q, o and norm where there is one (2 blocks).
    assert_eq!(check.leaf_groups, 4 * 3 + 2 + 2 * 3, "{check:?}");
}

#[test]
fn an_optional_module_of_several_leaves_taken_as_one_leaf_names_the_fix() {
    let device = Device::flex();
    let (model, x) = (skips(&device), input(&device));
    // Its own group (the norm) exists: taking only that one used to leave q and o to load as strays.
    let error = check_streaming(model, &device, |weights| weights.forward(x.clone(), Reach::CrossByField))
        .expect_err("cross holds several leaf groups");
    let message = error.to_string();
    assert!(matches!(error, Error::Streaming { ref level, .. } if level == "leaf level"), "{message}");
    for wanted in ["block blocks.1", "\"cross\"", "\"cross.q\"", "narrow!(block, cross).some()"] {
        assert!(message.contains(wanted), "the message names {wanted}: {message}");
    }
}

#[test]
fn a_norm_taken_by_its_field_streams_with_the_group_that_holds_it() {
    let device = Device::flex();
    let (model, x) = (skips(&device), input(&device));
    check_streaming(model, &device, |weights| weights.forward(x.clone(), Reach::NormByField))
        .expect("leaf!(block, norm) takes the group the norm's weights travel with");
}

#[test]
fn a_module_of_several_leaves_taken_as_one_leaf_names_the_block_the_path_and_the_fix() {
    let device = Device::flex();
    let (model, x) = (skips(&device), input(&device));
    let error = check_streaming(model, &device, |weights| weights.forward(x.clone(), Reach::MlpByField))
        .expect_err("mlp holds two leaf groups");
    let message = error.to_string();
    assert!(matches!(error, Error::Streaming { ref level, .. } if level == "leaf level"), "{message}");
    for wanted in ["blocks.0", "\"mlp\"", "\"mlp.up\"", "\"mlp.down\"", "narrow!(block, mlp)"] {
        assert!(message.contains(wanted), "the message names {wanted}: {message}");
    }
}

/// A stage with blocks and nothing else: its rest holds no weights (a zero-byte group at either level).
#[derive(Module, Debug, OffloadModel)]
struct Stage {
    #[offload(blocks)]
    blocks: Vec<SkipBlock>,
}

#[derive(Module, Debug, OffloadModel)]
struct Stages {
    embed: Linear,
    #[offload(nested)]
    stages: Vec<Stage>,
}

impl StagesWeights<'_> {
    fn forward(self, x: Tensor<2>) -> Result<Tensor<2>> {
        let x = self.shell.get()?.embed.forward(x);
        self.stages.iter().try_fold(x, |x, stage| stage.blocks.fold(x, |block, x| skip_block(&block, x, Reach::Guide)))
    }
}

#[test]
fn groups_are_counted_by_one_rule_at_both_levels() {
    let device = Device::flex();
    let Skips { embed, blocks } = skips(&device);
    let mut blocks = blocks.into_iter();
    let model = Stages {
        embed,
        stages: vec![Stage { blocks: blocks.by_ref().take(2).collect() }, Stage { blocks: blocks.collect() }],
    };
    let layout = measure_layout(&model).expect("the model names blocks");
    let x = input(&device);
    let check = check_streaming(model, &device, |weights| weights.forward(x.clone())).expect("it streams");
    // One rule: a group that holds weights, the layers outside the declared parts (the shell) left out. The
    // stages' rests hold none, so they count at neither level; the census counts the same groups.
    assert_eq!(check.block_groups, 4, "{check:?}");
    assert_eq!(check.block_groups, layout.block_bytes.len(), "{check:?} against {layout:?}");
    assert_eq!(check.leaf_groups, 4 * 3 + 2 + 2 * 3, "{check:?}");
    assert_eq!(check.leaf_groups, layout.leaf_count, "{check:?} against {layout:?}");
}

/// The block list of `Skips`, whose blocks' forwards take their norm first (a path under no leaf of its own).
#[derive(Module, Debug, OffloadModel)]
struct NormFirst {
    #[offload(blocks, first = norm)]
    blocks: Vec<SkipBlock>,
}

/// The same, naming a module of several leaves first (which `leaf!` refuses: no one leaf).
#[derive(Module, Debug, OffloadModel)]
struct MlpFirst {
    #[offload(blocks, first = mlp)]
    blocks: Vec<SkipBlock>,
}

#[test]
fn the_first_leaf_resolves_as_leaf_does() {
    let device = Device::flex();
    let norm = (2 * 8 * 4) as u64;
    // The block's norm travels with the block's own group: what `leaf!(block, norm)` takes.
    let layout = measure_layout(&NormFirst { blocks: skips(&device).blocks }).expect("blocks");
    assert_eq!(layout.first_leaf_bytes, norm, "{layout:?}");
    // A module of several leaves is no first leaf: nothing is named, rather than its block's own group.
    let layout = measure_layout(&MlpFirst { blocks: skips(&device).blocks }).expect("blocks");
    assert_eq!(layout.first_leaf_bytes, 0, "{layout:?}");
}
