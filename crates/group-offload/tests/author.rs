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

/// A block whose skip projection exists in some blocks only.
#[derive(Module, Debug)]
struct SkipBlock {
    mlp: Mlp,
    skip: Option<Linear>,
    norm: LayerNorm,
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
    let h = match reach {
        Reach::MlpByField => {
            let mlp = &leaf!(block, mlp);
            mlp.down.forward(mlp.up.forward(x.clone()))
        }
        Reach::Guide | Reach::NormByField => {
            let mlp = narrow!(block, mlp);
            leaf!(mlp, down).forward(leaf!(mlp, up).forward(x.clone()))
        }
    };
    Ok(match reach {
        Reach::NormByField => leaf!(block, norm).forward(x + h),
        Reach::Guide | Reach::MlpByField => block.own()?.norm.forward(x + h),
    })
}

fn skips(device: &Device) -> Skips {
    let linear = || LinearConfig::new(8, 8).init(device);
    let block = |skip: bool| SkipBlock {
        mlp: Mlp { up: linear(), down: linear() },
        skip: skip.then(linear),
        norm: LayerNormConfig::new(8).init(device),
    };
    Skips { embed: linear(), blocks: vec![block(true), block(false), block(true), block(false)] }
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
    // Per block: mlp.up, mlp.down, the norm's group, and the skip where there is one.
    assert_eq!(check.leaf_groups, 4 * 3 + 2, "{check:?}");
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
    assert_eq!(check.leaf_groups, 4 * 3 + 2, "{check:?}");
    assert_eq!(check.leaf_groups, layout.leaf_count, "{check:?} against {layout:?}");
}
