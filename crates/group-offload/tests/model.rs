//! The one trait for a model under offload: a model declared once runs the same forward resident and streamed
//! at both levels, the free streaming check catches a forward that reads a weight through the wrong part or a
//! path that names no group, and a `ModelHandle` switches a registered model to group offload in place.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::{Device, Distribution, Tensor};
use group_offload::{
    Blocks, Error, GroupLevel, GroupOptions, Layer, ModelHandle, OffloadDevice, OffloadModel, Shell, check_streaming,
    model::Census, model::Split, model::Streamed, model::measure_layout, parts::ModuleOffload,
};
use offload_core::{Action, ComponentsManager, Reason};

#[derive(Module, Debug)]
struct Block {
    fc1: Linear,
    fc2: Linear,
    norm: LayerNorm,
}

#[derive(Module, Debug)]
struct Net {
    embed: Linear,
    blocks: Vec<Block>,
    head: Linear,
}

#[derive(Clone, Copy)]
struct NetWeights<'a> {
    shell: Shell<'a, Net>,
    blocks: Blocks<'a, Block>,
}

struct NetParts {
    shell: ModuleOffload<Net>,
    blocks: Streamed<Block>,
}

impl OffloadModel for Net {
    const CLASS: &'static str = "Net";
    type Weights<'a> = NetWeights<'a>;
    type Parts = NetParts;

    fn weights(&self) -> NetWeights<'_> {
        NetWeights { shell: Shell::Resident(self), blocks: Blocks::Resident(&self.blocks) }
    }

    fn streamed(parts: &NetParts) -> NetWeights<'_> {
        NetWeights { shell: Shell::Streamed(&parts.shell), blocks: Blocks::Streamed(&parts.blocks) }
    }

    fn split(mut self, split: &Split<'_>) -> group_offload::Result<NetParts> {
        let blocks = split.blocks("blocks", std::mem::take(&mut self.blocks))?;
        Ok(NetParts { shell: split.shell(self)?, blocks })
    }

    fn census(&self, census: &mut Census) {
        census.blocks_from(&self.blocks, Some("fc1"));
    }
}

/// The forward, with the path it takes the second projection at (`"fc2"` when correct).
fn forward(weights: NetWeights<'_>, x: Tensor<2>, fc2_at: &str) -> Result<Tensor<2>, Error> {
    let x = weights.shell.get()?.embed.forward(x);
    let x = weights.blocks.fold(x, |block: Layer<'_, Block>, x| {
        let h = block.part("fc1")?.fc1.forward(x.clone());
        let h = block.part(fc2_at)?.fc2.forward(h);
        Ok(block.own()?.norm.forward(x + h))
    })?;
    Ok(weights.shell.get()?.head.forward(x))
}

fn net(device: &Device) -> Net {
    let block = || Block {
        fc1: LinearConfig::new(16, 32).init(device),
        fc2: LinearConfig::new(32, 16).init(device),
        norm: LayerNormConfig::new(16).init(device),
    };
    Net {
        embed: LinearConfig::new(8, 16).init(device),
        blocks: (0..4).map(|_| block()).collect(),
        head: LinearConfig::new(16, 4).init(device),
    }
}

fn input(device: &Device) -> Tensor<2> {
    Tensor::random([3, 8], Distribution::Normal(0.0, 1.0), device)
}

#[test]
fn a_model_declared_once_streams_at_both_levels_as_it_runs_resident() {
    let device = Device::flex();
    let (model, x) = (net(&device), input(&device));
    let check = check_streaming(model, &device, |weights| forward(weights, x.clone(), "fc2")).expect("it streams");
    assert_eq!(check.block_groups, 4);
    // Per block: fc1, fc2, and the group of the norm (parameters under no leaf travel with their block); the
    // shell is counted at neither level.
    assert_eq!(check.leaf_groups, 4 * 3, "{check:?}");
    assert!(check.max_relative_difference <= 1e-4, "{check:?}");
}

#[test]
fn a_forward_that_reads_a_weight_through_another_part_fails_the_free_check() {
    let device = Device::flex();
    let (model, x) = (net(&device), input(&device));
    // Takes fc1's group, then uses fc2 through it: at leaf level fc2's weights are not on the device.
    let error = check_streaming(model, &device, |weights| forward(weights, x.clone(), "fc1")).expect_err("caught");
    let message = error.to_string();
    assert!(matches!(error, Error::Streaming { ref level, .. } if level == "leaf level"), "{message}");
    assert!(message.contains("outside their group") && message.contains("fc2"), "{message}");
}

#[test]
fn a_path_left_behind_by_a_rename_fails_the_free_check() {
    let device = Device::flex();
    let (model, x) = (net(&device), input(&device));
    let error = check_streaming(model, &device, |weights| forward(weights, x.clone(), "fc_2")).expect_err("caught");
    let message = error.to_string();
    assert!(matches!(error, Error::Streaming { .. }), "{message}");
    assert!(message.contains("\"fc_2\"") && message.contains("\"fc2\""), "names the path and the groups: {message}");
}

#[test]
fn the_census_gives_the_planners_layout() {
    let device = Device::flex();
    let model = net(&device);
    let layout = measure_layout(&model).expect("the model names blocks");
    let block = (16 * 32 + 32) * 4 + (32 * 16 + 16) * 4 + 2 * 16 * 4;
    assert_eq!(layout.block_bytes, vec![block as u64; 4]);
    assert_eq!(layout.outside_bytes, ((8 * 16 + 16) + (16 * 4 + 4)) * 4);
    assert_eq!(layout.leaf_count, 12);
    assert_eq!(layout.first_leaf_bytes, (16 * 32 + 32) * 4);
    assert_eq!(layout.largest_leaf_bytes, (16 * 32 + 32) * 4);
}

#[test]
fn a_handle_runs_the_one_forward_whole_then_streamed_and_records_the_group_moves() {
    let device = Device::flex();
    let manager = Arc::new(ComponentsManager::new());
    let x = input(&device);
    let mut handle =
        ModelHandle::register(&manager, "net", net(&device), OffloadDevice::host_only()).expect("registers");
    let whole = handle.run(0, |weights, _| forward(weights, x.clone(), "fc2")).expect("runs whole");
    assert!(!handle.is_grouped());
    assert_eq!(handle.layout().expect("whole").expect("blocks").block_bytes.len(), 4);

    let options = GroupOptions { level: GroupLevel::Leaf, ..GroupOptions::leaf() };
    handle.enable_group_offload(&options).expect("streams");
    assert!(handle.is_grouped());
    assert_eq!(manager.ids(), vec![handle.id().to_string()], "one registration, under the new id");
    for _ in 0..2 {
        let streamed = handle.run(0, |weights, _| forward(weights, x.clone(), "fc2")).expect("runs streamed");
        let difference: f32 = (streamed - whole.clone()).abs().max().into_scalar();
        assert!(difference <= 1e-5, "{difference}");
    }
    let stats = handle.group_stats().expect("grouped");
    assert_eq!(stats.stray_loads, 0);
    assert!(stats.prefetches > 0 && stats.misses == 0, "prefetched in the captured order: {stats:?}");
    let record = manager.offload_record();
    let onloads = record.events().into_iter().filter(|e| e.reason == Some(Reason::GroupOnload)).count();
    assert!(onloads > 0, "group uploads are typed record reasons: {record}");
    assert!(record.events().iter().any(|e| e.action == Action::Onload && e.id.starts_with("net/")));

    // Its blocks cannot be measured again, and enabling twice keeps the first options.
    assert!(matches!(handle.layout(), Err(Error::AlreadyApplied { .. })));
    handle.enable_group_offload(&GroupOptions::default()).expect("does nothing");
}

/// A model that declares no blocks.
#[derive(Module, Debug)]
struct Head {
    fc: Linear,
}

impl OffloadModel for Head {
    const CLASS: &'static str = "Head";
    type Weights<'a> = &'a Head;
    type Parts = std::convert::Infallible;

    fn weights(&self) -> &Head {
        self
    }

    fn streamed(parts: &std::convert::Infallible) -> &Head {
        match *parts {}
    }
}

#[test]
fn a_model_without_blocks_is_refused_group_offload_and_stays_registered() {
    let device = Device::flex();
    let manager = Arc::new(ComponentsManager::new());
    let head = Head { fc: LinearConfig::new(8, 2).init(&device) };
    let mut handle = ModelHandle::register(&manager, "head", head, OffloadDevice::host_only()).expect("registers");
    let id = handle.id().to_string();
    let error = handle.enable_group_offload(&GroupOptions::default()).expect_err("refused");
    assert!(matches!(error, Error::RouteUnsupported { .. }), "{error}");
    assert!(error.to_string().contains("declares no parts that stream"), "{error}");
    assert_eq!(handle.id(), id);
    assert_eq!(manager.ids(), vec![id]);
    let x = input(&device);
    let out = handle.run(0, |head, _| Ok(head.fc.forward(x.clone()))).expect("still runs whole");
    assert_eq!(out.dims(), [3, 2]);
}

/// A model whose forward takes parts more than once: the shell before and after the blocks, a block applied
/// twice, and a head tied to the embedding (both read through the shell's one group).
#[derive(Module, Debug, group_offload::OffloadModel)]
struct Repeats {
    embed: Linear,
    #[offload(blocks)]
    blocks: Vec<Block>,
    #[offload(block)]
    last: Block,
    head: Linear,
}

impl RepeatsWeights<'_> {
    fn forward(self, x: Tensor<2>) -> group_offload::Result<Tensor<2>> {
        let mut x = self.shell.get()?.embed.forward(x);
        for block in self.blocks.iter() {
            x = block_forward(&block?, x)?;
        }
        // Block 1 again, then the single block twice: each take is a step of the captured order.
        if let Some(block) = self.blocks.get(1) {
            x = block_forward(&block?, x)?;
        }
        for _ in 0..2 {
            x = block_forward(&self.last.get()?, x)?;
        }
        let shell = self.shell.get()?;
        Ok(shell.head.forward(shell.embed.forward(x.clone().narrow(1, 0, 8)) + x))
    }
}

fn block_forward(block: &Layer<'_, Block>, x: Tensor<2>) -> group_offload::Result<Tensor<2>> {
    let h = group_offload::leaf!(block, fc1).forward(x.clone());
    let h = group_offload::leaf!(block, fc2).forward(h);
    Ok(block.own()?.norm.forward(x + h))
}

#[test]
fn a_forward_that_takes_parts_twice_is_captured_whole_with_no_miss_at_both_levels() {
    let device = Device::flex();
    let Net { embed, blocks, .. } = net(&device);
    let model =
        Repeats { embed, blocks, last: net(&device).blocks.remove(0), head: LinearConfig::new(16, 4).init(&device) };
    let x = input(&device);
    let resident = group_offload::whole(model.weights().forward(x.clone()));
    // The free check fails on a second forward's miss or new step, at either level.
    let check = check_streaming(model.clone(), &device, |weights| weights.forward(x.clone())).expect("it streams");
    assert_eq!(check.block_groups, 5, "{check:?}");
    for options in [GroupOptions::default(), GroupOptions::leaf()] {
        let manager = Arc::new(ComponentsManager::new());
        let card = memory_sim::SimCard::new(memory_sim::CardSpec::parse("1GB").expect("a size"));
        let mut handle =
            ModelHandle::register(&manager, "repeats", model.clone(), OffloadDevice::simulated(card.clone()))
                .expect("registers");
        handle.enable_group_offload(&options).expect("streams");
        manager.enable_auto_offload(card, 0, true).expect("auto offload");
        for _ in 0..3 {
            let out = handle.run(0, |weights, device| weights.forward(x.clone().to_device(device))).expect("runs");
            let difference = (out - resident.clone()).abs().max().into_scalar::<f32>();
            assert!(difference <= 1e-5, "{:?}: differs by {difference}", options.level);
        }
        let stats = handle.group_stats().expect("grouped");
        assert_eq!((stats.misses, stats.order_inserts), (0, 0), "{:?}: {stats:?}", options.level);
        let order = handle.group_offload().expect("grouped").order();
        assert_eq!(order.iter().filter(|id| id.ends_with("/shell")).count(), 2, "{order:?}");
        let last = order.iter().filter(|id| id.starts_with("repeats/last")).count();
        assert!(last >= 2, "{:?}: the single block is taken twice: {order:?}", options.level);
    }
}
