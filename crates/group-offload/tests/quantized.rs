//! Quantized models under group offload: block and leaf streaming of burn quantized weights give the resident
//! output bit for bit, their groups hold and move the quantized bytes (values and scales: the sizes the
//! planner's layout reads), and the disk store keeps and reuses them.

use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::quantization::{QuantScheme, QuantStore, QuantValue, ScaleDtype};
use burn::tensor::{DType, Device, Distribution, Tensor};
use group_offload::whole::tensor_bytes;
use group_offload::{
    GroupLevel, GroupOptions, Layer, ModelHandle, OffloadDevice, OffloadModel, check_streaming, leaf, module_bytes,
};
use offload_core::{Action, ComponentsManager};

/// Dimensions that are not multiples of 4, so a weight's values end off a word boundary before their scale.
const DIM: usize = 15;
const HIDDEN: usize = 30;

#[derive(Module, Debug)]
struct Block {
    fc1: Linear,
    fc2: Linear,
    norm: LayerNorm,
}

#[derive(Module, Debug, group_offload::OffloadModel)]
struct Net {
    embed: Linear,
    #[offload(blocks)]
    blocks: Vec<Block>,
    head: Linear,
}

impl NetWeights<'_> {
    fn forward(self, x: Tensor<2>) -> group_offload::Result<Tensor<2>> {
        let x = self.shell.get()?.embed.forward(x);
        let x = self.blocks.fold(x, |block: Layer<'_, Block>, x| {
            let h = leaf!(block, fc1).forward(x.clone());
            let h = leaf!(block, fc2).forward(h);
            Ok(block.own()?.norm.forward(x + h))
        })?;
        Ok(self.shell.get()?.head.forward(x))
    }
}

fn net(device: &Device) -> Net {
    net_of(device, 7, DIM, HIDDEN)
}

/// The net with an input width, a width and a hidden width.
fn net_of(device: &Device, inputs: usize, dim: usize, hidden: usize) -> Net {
    device.seed(3);
    let block = || Block {
        fc1: LinearConfig::new(dim, hidden).init(device),
        fc2: LinearConfig::new(hidden, dim).init(device),
        norm: LayerNormConfig::new(dim).init(device),
    };
    Net {
        embed: LinearConfig::new(inputs, dim).init(device),
        blocks: (0..4).map(|_| block()).collect(),
        head: LinearConfig::new(dim, dim).init(device),
    }
}

fn input(device: &Device) -> Tensor<2> {
    input_of(device, 7)
}

fn input_of(device: &Device, inputs: usize) -> Tensor<2> {
    device.seed(5);
    Tensor::random([3, inputs], Distribution::Normal(0.0, 1.0), device)
}

/// `model` with every rank-2 float parameter (the linear weights) quantized with `scheme`.
fn quantized<M: Module>(model: M, scheme: QuantScheme) -> M {
    struct Weights(QuantScheme);
    impl ModuleMapper for Weights {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if D != 2 {
                return param;
            }
            let scheme = self.0;
            param.map(|weight| weight.quantize_dynamic(&scheme))
        }
    }
    model.map(&mut Weights(scheme))
}

/// The schemes the CPU backend computes, per tensor and per block (blocks of 15 along the last dimension).
fn schemes() -> Vec<QuantScheme> {
    let q8 = QuantScheme::default().with_value(QuantValue::Q8S).with_store(QuantStore::Native);
    let q4 = QuantScheme::default().with_value(QuantValue::Q4S).with_store(QuantStore::Native);
    vec![q8, q4, q8.per_block([DIM as u8], ScaleDtype::F32), q4.per_block([DIM as u8], ScaleDtype::F16)]
}

#[test]
fn quantized_weights_stream_at_both_levels_bit_for_bit() {
    let device = Device::flex();
    let x = input(&device);
    for scheme in schemes() {
        let model = quantized(net(&device), scheme);
        let check = check_streaming(model, &device, |weights| weights.forward(x.clone()))
            .unwrap_or_else(|e| panic!("{scheme:?}: {e}"));
        // The groups rebuild the very tensors the resident model holds, so the products are the same operations
        // on the same values.
        assert_eq!(check.max_relative_difference, 0.0, "{scheme:?}: {check:?}");
        assert_eq!(check.block_groups, 4, "{check:?}");
    }
}

#[test]
fn a_quantized_tensors_counted_bytes_are_its_data_values_and_scales() {
    let device = Device::flex();
    struct Sizes(Vec<(u64, usize, bool)>);
    impl ModuleVisitor for Sizes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            let quantized = matches!(tensor.dtype(), DType::QFloat(_));
            self.0.push((tensor_bytes(&tensor), tensor.into_data().as_bytes().len(), quantized));
        }
    }
    for scheme in schemes() {
        let mut sizes = Sizes(Vec::new());
        quantized(net(&device), scheme).visit(&mut sizes);
        assert!(sizes.0.iter().filter(|(_, _, q)| *q).count() == 10, "{scheme:?}: every linear weight");
        for (counted, held, _) in &sizes.0 {
            assert_eq!(*counted, *held as u64, "{scheme:?}: the counted bytes are the data's");
        }
    }
    // A [7, 15] Q8S weight: 105 one-byte values and one f32 scale, with no padding between them.
    let weight = Tensor::<2>::zeros([7, 15], &device).quantize_dynamic(&schemes()[0]);
    assert_eq!(tensor_bytes(&weight), 105 + 4);
}

#[test]
fn a_quantized_model_streams_its_quantized_bytes_as_the_layout_predicts() {
    let device = Device::flex();
    let x = input(&device);
    let float_bytes = module_bytes(&net(&device));
    for level in [GroupLevel::Block { blocks_per_group: 1 }, GroupLevel::Leaf] {
        let model = quantized(net(&device), schemes()[0]);
        let resident = group_offload::whole(model.weights().forward(x.clone()));
        let bytes = module_bytes(&model);
        assert!(bytes * 3 < float_bytes, "8-bit weights: {bytes} of {float_bytes} float bytes");
        let manager = Arc::new(ComponentsManager::new());
        let card = memory_sim::SimCard::new(
            memory_sim::CardSpec::parse("64MB")
                .expect("a size")
                .with_mode(memory_sim::Mode::Hard)
                .with_context_overhead(0),
        );
        let mut handle =
            ModelHandle::register(&manager, "net", model, OffloadDevice::simulated(card.clone())).expect("registers");
        let layout = handle.layout().expect("whole").expect("blocks");
        let options = GroupOptions { level, ..GroupOptions::default() };
        handle.enable_group_offload(&options).expect("a quantized model streams");
        manager.enable_auto_offload(card, 0, true).expect("auto offload");
        let groups = handle.group_offload().expect("grouped").groups();
        assert_eq!(groups.iter().map(|(_, b)| b).sum::<u64>(), bytes, "{level:?}: the groups hold the model's bytes");
        if level != GroupLevel::Leaf {
            let blocks: Vec<u64> =
                groups.iter().filter(|(id, _)| id.starts_with("net/blocks_")).map(|(_, b)| *b).collect();
            assert_eq!(blocks, layout.block_bytes, "each block group is the size the planner reads");
        }
        let mut moved = Vec::new();
        for _ in 0..3 {
            let before = handle.group_stats().expect("grouped").bytes_onloaded;
            let out = handle.run(0, |weights, device| weights.forward(x.clone().to_device(device))).expect("runs");
            assert_eq!(out.into_data(), resident.clone().into_data(), "{level:?}: streamed output differs");
            // The prefetches the forward asked for count towards it once they landed.
            handle.group_offload().expect("grouped").wait_idle();
            moved.push(handle.group_stats().expect("grouped").bytes_onloaded - before);
        }
        let record = manager.offload_record();
        let onloaded: u64 = record
            .events()
            .iter()
            .filter(|e| e.action == Action::Onload && e.id.starts_with("net/"))
            .map(|e| e.bytes)
            .sum();
        assert_eq!(onloaded, moved.iter().sum::<u64>(), "{level:?}: the record charges the bytes that moved");
        assert_eq!(moved[1], moved[2], "{level:?}: every steady forward moves the same bytes");
        assert!(moved[1] > 0 && moved[1] <= bytes, "{level:?}: {moved:?}");
    }
}

#[test]
fn the_disk_store_keeps_quantized_groups_and_reuses_their_files() {
    let device = Device::flex();
    let x = input(&device);
    let dir = std::env::temp_dir().join(format!("group-offload-quantized-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut stamps = Vec::new();
    // One model for both builds: tests run in parallel and share the device's seed.
    let model = quantized(net(&device), schemes()[2]);
    for _ in 0..2 {
        let model = model.clone();
        let resident = group_offload::whole(model.weights().forward(x.clone()));
        let manager = Arc::new(ComponentsManager::new());
        let mut handle = ModelHandle::register(&manager, "net", model, OffloadDevice::host_only()).expect("registers");
        let options = GroupOptions { disk_store: Some(dir.clone()), ..GroupOptions::default() };
        handle.enable_group_offload(&options).expect("streams from disk");
        for _ in 0..2 {
            let out = handle.run(0, |weights, device| weights.forward(x.clone().to_device(device))).expect("runs");
            assert_eq!(out.into_data(), resident.clone().into_data(), "read back from disk, the output is the same");
        }
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .expect("the store")
            .map(|e| {
                let entry = e.expect("an entry");
                (entry.file_name(), entry.metadata().expect("metadata").modified().expect("a time"))
            })
            .collect();
        files.sort();
        assert_eq!(files.len(), handle.group_offload().expect("grouped").groups().len(), "one file per group");
        stamps.push(files);
    }
    assert_eq!(stamps[0], stamps[1], "the second build reused every file: their content hashes matched");
    let _ = std::fs::remove_dir_all(&dir);
}

/// On a real cubecl runtime (burn's wgpu; in CI Mesa's lavapipe): weights quantized on the device, in the
/// runtime's own packed layout, stream at both levels with the resident output bit for bit, and their groups
/// are the sizes the layout counts. `cargo test -p group-offload --features wgpu --test quantized`.
#[cfg(feature = "wgpu")]
#[test]
fn on_a_cubecl_runtime_weights_quantized_there_stream_bit_for_bit() {
    let name = offload_core::DeviceName::parse("wgpu").expect("a device name");
    let device = group_offload::device::open_device_with(&name, group_offload::device::PagePolicy::Exclusive)
        .unwrap_or_else(|error| panic!("{error} (this test needs a Vulkan driver)"));
    // A packed store needs every weight's last dimension to be a whole number of words (8 values for 4 bits).
    let x = input_of(&device, 8);
    let packed = [QuantValue::Q8S, QuantValue::Q4S]
        .map(|value| QuantScheme::default().with_value(value).with_store(QuantStore::PackedU32(0)));
    for scheme in packed {
        let model = quantized(net_of(&device, 8, 16, 32), scheme);
        let check = check_streaming(model.clone(), &device, |weights| weights.forward(x.clone()))
            .unwrap_or_else(|e| panic!("{scheme:?}: {e}"));
        assert_eq!(check.max_relative_difference, 0.0, "{scheme:?}: {check:?}");
        let layout = group_offload::model::measure_layout(&model).expect("blocks");
        let manager = Arc::new(ComponentsManager::new());
        let placement = OffloadDevice::on_device(device.clone(), name.clone(), Arc::new(offload_core::NoLedger), None);
        let mut handle = ModelHandle::register(&manager, "net", model, placement).expect("registers");
        handle.enable_group_offload(&GroupOptions::default()).expect("streams");
        let groups = handle.group_offload().expect("grouped").groups();
        let blocks: Vec<u64> = groups.iter().filter(|(id, _)| id.starts_with("net/blocks_")).map(|(_, b)| *b).collect();
        assert_eq!(blocks, layout.block_bytes, "{scheme:?}: the packed groups are the sizes the layout counts");
        println!("{scheme:?} on {name}: block groups {blocks:?}");
    }
}
