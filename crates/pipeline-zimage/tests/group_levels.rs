//! Group offload of the text encoder and the transformer at block and leaf level on the tiny checkpoint: the
//! outputs equal the resident ones, no weight is touched without its group being taken, prefetch misses nothing
//! after the capture, and leaf level holds less on the device than block level.

use std::sync::Arc;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use group_offload::OffloadDevice;
use group_offload::config::GroupOffloadConfig;
use group_offload::{GroupLevel, GroupOptions, handle::GroupedModel};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::{DeviceMemory, Offloadable};
use pipeline_zimage::loading::{Checkpoint, LoadOptions};
use pipeline_zimage::text_encoder::TextEncoder;
use pipeline_zimage::transformer::ZImageTransformer2DModel;

mod common;

use common::{fixtures, golden, load_tiny, max_abs_diff, turbo_options, values};

const LEVELS: [GroupLevel; 3] =
    [GroupLevel::Block { blocks_per_group: 1 }, GroupLevel::Block { blocks_per_group: 2 }, GroupLevel::Leaf];

fn transformer() -> ZImageTransformer2DModel {
    let checkpoint = Checkpoint::open(fixtures().join("tiny-z-image-turbo")).expect("the tiny checkpoint opens");
    let (model, report) = checkpoint.load_transformer(&Device::flex(), &LoadOptions::new()).expect("it loads");
    assert!(report.is_complete(), "{report}");
    model
}

fn text_encoder() -> TextEncoder {
    let dir = fixtures().join("tiny-z-image-turbo/text_encoder");
    TextEncoder::load(dir, &Device::flex(), &LoadOptions::default()).expect("the tiny text encoder loads").1
}

/// A hard simulated card with room to spare, to measure what group offload puts on it.
fn card() -> Arc<SimCard> {
    SimCard::new(CardSpec::parse("1GiB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0))
}

fn config(model: &str, card: &Arc<SimCard>) -> GroupOffloadConfig {
    GroupOffloadConfig::new(model, OffloadDevice::simulated(card.clone()))
}

fn options(level: GroupLevel) -> GroupOptions {
    GroupOptions { level, ..GroupOptions::default() }
}

/// The largest group that is not the resident shell.
fn largest_streamed_group(groups: &[(String, u64)]) -> u64 {
    groups.iter().filter(|(id, _)| !id.ends_with("shell")).map(|(_, bytes)| *bytes).max().unwrap_or(0)
}

/// The golden transformer inputs: latents `[1, C, F, H, W]`, time `[1]`, caption features `[1, L, D]`.
fn transformer_inputs(device: &Device) -> (Tensor<5>, Tensor<1>, Tensor<3>) {
    let golden = golden("transformer.safetensors");
    let input = |name: &str| {
        let (shape, values) = &golden[name];
        TensorData::new(values.clone(), shape.clone())
    };
    let x = Tensor::<4>::from_data(input("x"), (device, DType::F32)).unsqueeze_dim(0);
    let t = Tensor::from_data(input("t"), (device, DType::F32));
    let cap = Tensor::<2>::from_data(input("cap_feats"), (device, DType::F32)).unsqueeze_dim(0);
    (x, t, cap)
}

#[test]
fn the_transformer_gives_the_resident_output_at_every_level_and_leaf_level_holds_least() {
    let device = Device::flex();
    let (x, t, cap) = transformer_inputs(&device);
    let resident = values(transformer().forward(x.clone(), t.clone(), cap.clone()));

    let mut peaks = Vec::new();
    for level in LEVELS {
        let card = card();
        let mut grouped =
            GroupedModel::<ZImageTransformer2DModel>::new(transformer(), config("transformer", &card), &options(level))
                .expect("groups");
        grouped.onload(&card.device()).expect("the shell uploads");
        for pass in 0..3 {
            let out = values(grouped.call(|w| w.forward(x.clone(), t.clone(), cap.clone())).expect("forward"));
            let error = max_abs_diff(&out, &resident);
            assert!(error <= 1e-6, "{level:?}, pass {pass}: differs from the resident output by {error}");
        }
        let offload = grouped.offload();
        offload.wait_idle();
        let stats = offload.stats();
        assert_eq!(stats.stray_loads, 0, "{level:?}: a weight was touched without its group: {stats:?}");
        assert_eq!(stats.misses, 0, "{level:?}: prefetch missed after the capture: {stats:?}");
        // On a model this small the worker is often still copying when the group is taken: a wait, not a miss.
        assert!(stats.prefetch_hits + stats.prefetch_waits > 0, "{level:?}: nothing was prefetched: {stats:?}");
        let groups = offload.groups();
        let bound = offload.resident_bytes() + 3 * largest_streamed_group(&groups);
        assert!(card.peak() <= bound, "{level:?}: peak {} above the ring bound {bound}", card.peak());
        if level == GroupLevel::Leaf {
            assert!(groups.iter().any(|(id, _)| id.ends_with("layers.0.attention.to_q")), "{groups:?}");
            assert!(groups.iter().any(|(id, _)| id.ends_with("layers.0.feed_forward.w2")), "{groups:?}");
        }
        peaks.push((level, card.peak()));
    }
    println!("device peak by level: {peaks:?}");
    let block = peaks[0].1;
    let leaf = peaks[2].1;
    assert!(leaf < block, "leaf level should hold less than one block per group: {peaks:?}");
}

/// The check every `OffloadModel` gets for free, on both streamed models of the tiny checkpoint: each forward
/// streams at block and leaf level as it runs resident, every leaf path names a group, no weight is read outside
/// the group that holds it, every group is taken, and the census names the blocks the split makes.
#[test]
fn the_transformer_and_the_text_encoder_pass_the_free_streaming_check() {
    let device = Device::flex();
    let (x, t, cap) = transformer_inputs(&device);
    let model = transformer();
    let blocks = model.noise_refiner.len() + model.context_refiner.len() + model.layers.len();
    let check =
        group_offload::check_streaming(model, &device, |weights| weights.forward(x.clone(), t.clone(), cap.clone()))
            .expect("the transformer streams");
    assert_eq!(check.block_groups, blocks);

    let ids: Tensor<2, Int> = Tensor::from_data(TensorData::new(vec![5i64, 9, 2, 7, 3, 1, 4, 8], [2, 4]), &device);
    let model = text_encoder();
    let layers = model.layers.len();
    let check = group_offload::check_streaming(model, &device, |weights| weights.forward(ids.clone()))
        .expect("the text encoder streams");
    assert_eq!(check.block_groups, layers);
}

#[test]
fn the_text_encoder_gives_the_resident_embeddings_at_every_level() {
    let device = Device::flex();
    let ids: Tensor<2, Int> =
        Tensor::from_data(TensorData::new(vec![5i64, 9, 2, 7, 3, 1, 4, 8, 0, 0], [2, 5]), &device);
    let mask = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 1, 1, 1, 1, 1, 1, 1, 0, 0], [2, 5]), &device)
        .equal_elem(1);
    let resident: Vec<Vec<f32>> =
        text_encoder().encode(ids.clone(), mask.clone()).expect("encode").into_iter().map(values).collect();

    for level in LEVELS {
        let card = card();
        let mut grouped =
            GroupedModel::<TextEncoder>::new(text_encoder(), config("text_encoder", &card), &options(level))
                .expect("groups");
        grouped.onload(&card.device()).expect("the embedding uploads");
        for pass in 0..2 {
            let embeds = grouped.call(|w| w.encode(ids.clone(), mask.clone())).expect("encode");
            assert_eq!(embeds.len(), resident.len());
            for (got, want) in embeds.into_iter().zip(&resident) {
                let error = max_abs_diff(&values(got), want);
                assert!(error <= 1e-6, "{level:?}, pass {pass}: differs from the resident embeddings by {error}");
            }
        }
        let stats = grouped.offload().stats();
        assert_eq!(stats.stray_loads, 0, "{level:?}: {stats:?}");
        assert_eq!(stats.misses, 0, "{level:?}: {stats:?}");
        // A bad mask is still the typed error it is without group offload.
        let bad = Tensor::<2, Int>::from_data(TensorData::new(vec![0i64, 1, 1, 1, 1, 1, 1, 1, 0, 0], [2, 5]), &device)
            .equal_elem(1);
        assert!(matches!(grouped.call(|w| w.encode(ids.clone(), bad)), Err(pipeline_zimage::Error::Shape { .. })));
    }
}

#[test]
fn the_pipeline_streams_both_encoders_at_leaf_level_and_gives_the_golden_image() {
    let (opts, golden_image) = turbo_options();
    let resident_placement = OffloadDevice::host_only();
    let resident = values(load_tiny(resident_placement).generate(&opts, &mut |_, _| {}).expect("resident run"));

    let card = card();
    let placement = OffloadDevice::simulated(card.clone());
    let mut pipeline = load_tiny(placement);
    let leaf = GroupOptions { releasable: true, ..GroupOptions::leaf() };
    for component in ["text_encoder", "transformer"] {
        pipeline.enable_group_offload_with(component, &leaf).expect("group offload");
        assert!(pipeline.is_grouped(component));
    }
    let error = pipeline.enable_group_offload_with("vae", &leaf).expect_err("the VAE has no blocks");
    assert!(
        matches!(error, pipeline_zimage::Error::GroupOffload(group_offload::Error::RouteUnsupported { .. })),
        "{error:?}"
    );
    assert_eq!(pipeline.manager().placement().len(), 3, "every component is still registered");

    pipeline.enable_auto_offload(0, true).expect("auto offload");
    let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("generate"));
    assert!(max_abs_diff(&image, &resident) <= 1e-6);
    assert!(max_abs_diff(&image, &golden_image) <= 1e-3);
    for component in ["text_encoder", "transformer"] {
        let stats = pipeline.group_stats(component).expect("grouped");
        assert!(stats.onloads > 0, "{component}: {stats:?}");
        assert_eq!(stats.stray_loads, 0, "{component}: {stats:?}");
    }
    let record = pipeline.manager().offload_record();
    assert!(record.events().iter().any(|e| e.id.starts_with("text_encoder/layers.0.self_attn.q_proj")), "{record}");
    assert!(record.events().iter().any(|e| e.id.starts_with("transformer/layers.0.feed_forward.w1")), "{record}");
}

#[test]
fn bad_group_options_are_typed_errors_that_leave_the_component_registered() {
    let card = card();
    let placement = OffloadDevice::simulated(card.clone());
    let mut pipeline = load_tiny(placement);
    let bad = [
        GroupOptions { level: GroupLevel::Block { blocks_per_group: 0 }, ..GroupOptions::default() },
        GroupOptions { prefetch: true, prefetch_depth: 0, ..GroupOptions::leaf() },
    ];
    for options in bad {
        for component in ["text_encoder", "transformer"] {
            let error = pipeline.enable_group_offload_with(component, &options).expect_err("the options are refused");
            assert!(
                matches!(error, pipeline_zimage::Error::GroupOffload(group_offload::Error::InvalidConfig { .. })),
                "{error:?}"
            );
            assert!(error.to_string().contains("use 1 or more") || error.to_string().contains("at least 1"), "{error}");
            assert!(!pipeline.is_grouped(component));
        }
    }
    assert_eq!(pipeline.manager().placement().len(), 3, "every component is still registered");
    assert_eq!(card.stats().allocations, 0, "nothing was placed on the card");
    let (opts, _) = turbo_options();
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    pipeline.generate(&opts, &mut |_, _| {}).expect("the pipeline still runs");
}
