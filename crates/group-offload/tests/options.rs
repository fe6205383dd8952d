//! Every count in the group options is bounded before anything reaches the engine: `GroupOptions` and
//! `GroupOffloadConfig` refuse a prefetch depth past `offload_core::plan::MAX_PREFETCH_DEPTH` (and 0 with prefetch
//! on) with a typed error naming the value, the bound and the fix, and `blocks_per_group` of `usize::MAX`
//! overflows nothing.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Distribution, Tensor};
use group_offload::config::GroupOffloadConfig;
use group_offload::parts::GroupOffload;
use group_offload::prelude::*;
use offload_core::ComponentsManager;
use offload_core::plan::MAX_PREFETCH_DEPTH;

#[derive(Module, Debug)]
struct Block {
    fc: Linear,
}

#[derive(Module, Debug, OffloadModel)]
struct Net {
    embed: Linear,
    #[offload(blocks)]
    blocks: Vec<Block>,
}

impl NetWeights<'_> {
    fn forward(self, x: Tensor<2>) -> Result<Tensor<2>> {
        let x = self.shell.get()?.embed.forward(x);
        self.blocks.fold(x, |block, x| Ok(x.clone() + leaf!(block, fc).forward(x)))
    }
}

fn net(device: &Device) -> Net {
    let linear = || LinearConfig::new(8, 8).init(device);
    Net { embed: linear(), blocks: (0..4).map(|_| Block { fc: linear() }).collect() }
}

fn input(device: &Device) -> Tensor<2> {
    Tensor::random([2, 8], Distribution::Normal(0.0, 1.0), device)
}

/// The message of `options`' refusal, which must be `InvalidConfig` naming each of `wanted`.
fn refused(options: &GroupOptions, wanted: &[&str]) -> String {
    let error = options.validate("net").expect_err("refused");
    let message = error.to_string();
    assert!(matches!(error, Error::InvalidConfig { .. }), "{message}");
    for wanted in wanted {
        assert!(message.contains(wanted), "the message names {wanted}: {message}");
    }
    message
}

#[test]
fn group_options_refuse_a_prefetch_depth_past_the_bound_or_zero_with_prefetch_on() {
    let past = GroupOptions { prefetch_depth: usize::MAX, ..GroupOptions::default() };
    let bound = MAX_PREFETCH_DEPTH.to_string();
    refused(&past, &["prefetch_depth", "18446744073709551615", &bound, "MAX_PREFETCH_DEPTH"]);
    let one_past = GroupOptions { prefetch_depth: MAX_PREFETCH_DEPTH + 1, ..GroupOptions::leaf() };
    refused(&one_past, &["prefetch_depth", &(MAX_PREFETCH_DEPTH + 1).to_string(), &bound]);
    // A depth past the bound is a mistake with prefetch off too: the value is refused, not kept for later.
    refused(&GroupOptions { prefetch: false, ..past.clone() }, &["prefetch_depth", &bound]);
    refused(&GroupOptions { prefetch_depth: 0, ..GroupOptions::default() }, &["prefetch_depth", "0", "prefetch"]);

    GroupOptions { prefetch_depth: MAX_PREFETCH_DEPTH, ..GroupOptions::default() }.validate("net").expect("the bound");
    GroupOptions { prefetch: false, prefetch_depth: 0, ..GroupOptions::default() }.validate("net").expect("unused");
    let zero = GroupOptions { level: GroupLevel::Block { blocks_per_group: 0 }, ..GroupOptions::default() };
    refused(&zero, &["blocks_per_group", "0", "1 or more"]);
}

#[test]
fn the_offloader_config_refuses_a_prefetch_depth_past_the_bound_before_its_engine_starts() {
    let device = Device::flex();
    let bound = MAX_PREFETCH_DEPTH.to_string();
    for depth in [usize::MAX, MAX_PREFETCH_DEPTH + 1] {
        let config = GroupOffloadConfig::new("net", device.clone()).with_prefetch_depth(depth);
        let error = config.validate().expect_err("refused");
        assert!(error.to_string().contains(&bound), "{error}");
        let error = GroupOffload::new(config).expect_err("no engine starts with it");
        let message = error.to_string();
        assert!(matches!(error, Error::InvalidConfig { .. }), "{message}");
        assert!(message.contains(&depth.to_string()) && message.contains(&bound), "{message}");
    }
    let zero = GroupOffloadConfig::new("net", device.clone()).with_prefetch_depth(0);
    assert!(GroupOffload::new(zero.clone()).is_err());
    GroupOffload::new(zero.with_prefetch(false)).expect("no prefetch, no depth needed");
    GroupOffload::new(GroupOffloadConfig::new("net", device).with_prefetch_depth(MAX_PREFETCH_DEPTH)).expect("bound");
}

#[test]
fn a_handle_given_a_prefetch_depth_past_the_bound_refuses_it_and_still_runs_whole() {
    let device = Device::flex();
    let (model, x) = (net(&device), input(&device));
    let resident = group_offload::whole(model.weights().forward(x.clone()));
    let manager = Arc::new(ComponentsManager::new());
    let mut handle = ModelHandle::register(&manager, "net", model, OffloadDevice::host_only()).expect("registers");
    // Before the bound, this depth reached the engine and panicked (`capacity overflow`) when the capture ended.
    let options = GroupOptions { prefetch_depth: usize::MAX, ..GroupOptions::default() };
    let error = handle.enable_group_offload(&options).expect_err("refused");
    assert!(error.to_string().contains(&MAX_PREFETCH_DEPTH.to_string()), "{error}");
    assert!(!handle.is_grouped());
    let out = handle.run(0, |weights, _| weights.forward(x.clone())).expect("still runs whole");
    assert_eq!(out.into_data(), resident.into_data());
}

#[test]
fn blocks_per_group_of_usize_max_is_one_group_of_every_block() {
    let device = Device::flex();
    let (model, x) = (net(&device), input(&device));
    let resident = group_offload::whole(model.weights().forward(x.clone()));
    let manager = Arc::new(ComponentsManager::new());
    let mut handle = ModelHandle::register(&manager, "net", model, OffloadDevice::host_only()).expect("registers");
    let options = GroupOptions { level: GroupLevel::Block { blocks_per_group: usize::MAX }, ..GroupOptions::default() };
    handle.enable_group_offload(&options).expect("streams");
    for _ in 0..2 {
        let out = handle.run(0, |weights, _| weights.forward(x.clone())).expect("runs");
        assert_eq!(out.into_data(), resident.clone().into_data());
    }
    let groups = handle.group_offload().expect("grouped").groups();
    let streamed: Vec<&str> = groups.iter().map(|(id, _)| id.as_str()).filter(|id| !id.ends_with("/shell")).collect();
    assert_eq!(streamed, ["net/blocks_0_3"], "{groups:?}");
}
