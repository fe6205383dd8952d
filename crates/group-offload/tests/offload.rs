//! Group offload on the flex CPU backend with a hard simulated card: equivalence, peaks, order, misses, failures,
//! accounting and the manager adapter.

#![allow(clippy::unwrap_used)] // A test fails loudly at the first unexpected error.

mod common;

use std::sync::Arc;
use std::time::Duration;

use burn::nn::Linear;
use burn::tensor::{Device, Tensor};
use common::{BLOCKS, Block, Model, Top, hard_card, input, max_abs_diff, slow_card};
use group_offload::{
    Error, LeafPredicate, OffloadDevice, component::GroupOffloadedModel, config::GroupOffloadConfig,
    parts::BlockOffload, parts::GroupOffload, parts::LeafOffload, parts::ModuleOffload, parts::Residency,
};
use memory_sim::SimCard;
use offload_core::{
    Action, ComponentsManager, DeviceLedger, DeviceMemory, DeviceName, OffloadRecord, Offloadable, Reason,
};

const GIB: u64 = 1 << 30;

fn config(card: &Arc<SimCard>, prefetch: bool) -> GroupOffloadConfig {
    config_with(card, prefetch, card.clone())
}

/// [`config`] with every move charged to `ledger` (a wrapper of the card's) and the card read.
fn config_with(card: &Arc<SimCard>, prefetch: bool, ledger: Arc<dyn DeviceLedger>) -> GroupOffloadConfig {
    let device =
        OffloadDevice::on_device(Device::flex(), DeviceName::parse("cuda").unwrap(), ledger, Some(card.clone()));
    GroupOffloadConfig::new("m", device).with_prefetch(prefetch)
}

/// A model under block-level offload: top-level layers resident (or streamed), blocks streamed.
struct BlockModel {
    offload: GroupOffload,
    top: ModuleOffload<Top>,
    blocks: BlockOffload<Block>,
}

impl BlockModel {
    fn new(model: Model, config: GroupOffloadConfig, per_group: usize, top: Residency) -> Self {
        let offload = GroupOffload::new(config).unwrap();
        let (rest, blocks) = model.split();
        let blocks = offload.blocks("blocks", blocks, per_group).unwrap();
        let top = offload.module("top", rest, top).unwrap();
        Self { offload, top, blocks }
    }

    /// One forward, as one [`GroupOffload::run`]: the first is the capture.
    fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, Error> {
        self.offload.run(|| self.forward_once(x))
    }

    fn forward_once(&self, x: Tensor<2>) -> Result<Tensor<2>, Error> {
        self.offload.ensure_device(&x.device())?;
        let mut x = {
            let top = self.top.get()?;
            top.pre.forward(x)
        };
        for group in self.blocks.iter() {
            let group = group?;
            for block in group.iter() {
                x = block.forward(x);
            }
        }
        let top = self.top.get()?;
        Ok(top.post.forward(x))
    }
}

/// The same model under leaf-level offload: every Linear its own group, each norm with its block.
fn leaf_forward(leaf: &LeafOffload<Model>, x: Tensor<2>) -> Result<Tensor<2>, Error> {
    let mut x = leaf.group("pre")?.pre.forward(x);
    for i in 0..BLOCKS {
        let h = leaf.group(&format!("blocks.{i}"))?.blocks[i].norm.forward(x.clone());
        let h = leaf.group(&format!("blocks.{i}.fc1"))?.blocks[i].fc1.forward(h);
        let h = leaf.group(&format!("blocks.{i}.fc2"))?.blocks[i].fc2.forward(burn::tensor::activation::gelu(h));
        x = x + h;
    }
    Ok(leaf.group("post")?.post.forward(x))
}

#[test]
fn block_level_matches_the_resident_model_with_and_without_prefetch() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    for prefetch in [false, true] {
        for per_group in [1, 2, 3, 4] {
            let card = hard_card(GIB);
            let offloaded = BlockModel::new(model.clone(), config(&card, prefetch), per_group, Residency::Resident);
            for pass in 0..3 {
                let out = offloaded.forward(x.clone()).unwrap();
                let diff = max_abs_diff(&out, &expected);
                assert!(diff <= 1e-6, "prefetch {prefetch}, {per_group} per group, pass {pass}: {diff}");
            }
            assert_eq!(offloaded.offload.stats().stray_loads, 0);
        }
    }
}

/// Without upload checks a group is published once its copies are queued: the output is the same, every upload
/// still moves and is accounted, and none is noted on the link meter (its time would be the queueing's, not
/// the link's).
#[test]
fn unchecked_uploads_give_the_same_output_and_time_no_link() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    for prefetch in [false, true] {
        let card = hard_card(GIB);
        let offloaded =
            BlockModel::new(model.clone(), config(&card, prefetch).with_upload_checks(false), 1, Residency::Resident);
        for pass in 0..3 {
            let out = offloaded.forward(x.clone()).unwrap();
            assert_eq!(max_abs_diff(&out, &expected), 0.0, "prefetch {prefetch}, pass {pass}");
        }
        offloaded.offload.wait_idle();
        let stats = offloaded.offload.stats();
        assert!(stats.onloads + stats.prefetches >= 3 * BLOCKS as u64, "{stats:?}");
        assert_eq!(offloaded.offload.link_rate(), None, "prefetch {prefetch}: {stats:?}");
    }
}

#[test]
fn leaf_level_matches_the_resident_model_with_and_without_prefetch() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    for prefetch in [false, true] {
        let card = hard_card(GIB);
        let offload = GroupOffload::new(config(&card, prefetch)).unwrap();
        let leaf = offload.leaves("model", model.clone(), &LeafPredicate::default()).unwrap();
        for _ in 0..3 {
            let out = offload.run(|| leaf_forward(&leaf, x.clone())).unwrap();
            assert!(max_abs_diff(&out, &expected) <= 1e-6);
        }
        let stats = offload.stats();
        assert_eq!(stats.stray_loads, 0, "{stats:?}");
        if prefetch {
            assert_eq!(stats.misses, 0, "{stats:?}");
        }
    }
}

#[test]
fn leaf_groups_put_each_norm_with_its_block() {
    let device = Device::flex();
    let card = hard_card(GIB);
    let offload = GroupOffload::new(config(&card, true)).unwrap();
    let leaf = offload.leaves("model", Model::new(&device), &LeafPredicate::default()).unwrap();
    let paths = leaf.group_paths();
    assert_eq!(&paths[..5], &["pre", "blocks.0", "blocks.0.fc1", "blocks.0.fc2", "blocks.1"]);
    assert_eq!(paths.len(), 2 + 3 * BLOCKS);
    let sizes = offload.groups();
    // The norm's gamma and beta (2 × 16 f32) travel together as the block's own group.
    assert_eq!(sizes[1], ("m/model.blocks.0".to_string(), 2 * 16 * 4));
    // A custom layer type can be a leaf too.
    let only_fc1 = LeafPredicate::new(|t| t == "Struct:Linear");
    assert!(only_fc1.is_leaf("Struct:Linear") && !only_fc1.is_leaf("Struct:PtLinear"));
}

#[test]
fn a_touched_parameter_outside_the_taken_groups_loads_itself_and_is_counted() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.pre.forward(x.clone());
    let card = hard_card(GIB);
    let offload = GroupOffload::new(config(&card, false)).unwrap();
    let leaf = offload.leaves("model", model, &LeafPredicate::default()).unwrap();
    // Take the post layer's group but run the pre layer: correct, and counted.
    let out = leaf.group("post").unwrap().pre.forward(x);
    assert!(max_abs_diff(&out, &expected) <= 1e-6);
    assert_eq!(offload.stats().stray_loads, 2);
}

/// A stray load whose disk file was removed while the model runs: the run fails with the disk error naming the
/// file (never a panic inside the placeholder), the stray is counted, and with the file written back the same run
/// gives the resident result again.
#[test]
fn a_stray_load_whose_disk_file_vanished_fails_the_run_typed_and_nothing_is_lost() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.pre.forward(x.clone());
    let dir = std::env::temp_dir().join(format!("group-offload-stray-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let card = hard_card(GIB);
    let offload = GroupOffload::new(config(&card, false).with_disk_store(&dir)).unwrap();
    let leaf = offload.leaves("model", model, &LeafPredicate::default()).unwrap();
    let files = offload.disk_files();
    assert_eq!(files.len(), leaf.group_paths().len(), "one file per leaf group, in the groups' order");
    let saved: Vec<_> = files.iter().map(|f| (f.clone(), std::fs::read(f).unwrap())).collect();
    for file in &files {
        std::fs::remove_file(file).unwrap();
    }
    // The post layer's group is taken (read from a file that is gone: that is an onload error), so take it with
    // its file back and remove the pre layer's only: the touch of `pre` is the stray whose file vanished.
    let post = leaf.group_paths().iter().position(|p| *p == "post").unwrap();
    std::fs::write(&saved[post].0, &saved[post].1).unwrap();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        offload.run(|| Ok::<_, Error>(leaf.group("post")?.pre.forward(x.clone())))
    }));
    let error = match outcome {
        Err(_) => panic!("a stray load of a vanished file panicked"),
        Ok(Ok(_)) => panic!("the run succeeded although a parameter it used could not be read"),
        Ok(Err(error)) => error,
    };
    assert!(matches!(error, Error::Disk { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains(&dir.display().to_string()) && message.contains("pre"), "{message}");
    assert!(offload.stats().stray_loads >= 1);
    for (file, bytes) in &saved {
        std::fs::write(file, bytes).unwrap();
    }
    let again = offload.run(|| Ok::<_, Error>(leaf.group("post")?.pre.forward(x.clone()))).unwrap();
    assert!(max_abs_diff(&again, &expected) <= 1e-6);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Peak of one steady forward on the fake card.
fn steady_peak(card: &SimCard, mut forward: impl FnMut()) -> u64 {
    forward();
    forward();
    card.reset_peak();
    forward();
    card.peak()
}

#[test]
fn peaks_order_leaf_block1_block3_resident_and_respect_the_ring_bound() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let total: u64 = {
        let card = hard_card(GIB);
        let offload = GroupOffload::new(config(&card, false)).unwrap();
        let _whole = offload.module("all", model.clone(), Residency::Resident).unwrap();
        offload.onload_resident().unwrap();
        card.peak()
    };

    let leaf_peak = |prefetch: bool| {
        let card = hard_card(GIB);
        let offload = GroupOffload::new(config(&card, prefetch)).unwrap();
        let leaf = offload.leaves("model", model.clone(), &LeafPredicate::default()).unwrap();
        let peak = steady_peak(&card, || {
            offload.run(|| leaf_forward(&leaf, x.clone())).unwrap();
        });
        let ring = if prefetch { 2 } else { 1 };
        assert!(
            peak <= ring * offload.largest_group(),
            "leaf ring bound: {peak} > {ring} × {}",
            offload.largest_group()
        );
        peak
    };
    let block_peak = |per_group: usize, prefetch: bool, depth: usize| {
        let card = hard_card(GIB);
        let config = config(&card, prefetch).with_prefetch_depth(depth);
        let offloaded = BlockModel::new(model.clone(), config, per_group, Residency::Resident);
        let peak = steady_peak(&card, || {
            offloaded.forward(x.clone()).unwrap();
        });
        let ring = if prefetch { depth as u64 + 1 } else { 1 };
        let bound = offloaded.offload.resident_bytes() + ring * offloaded.offload.largest_group();
        assert!(peak <= bound, "{per_group} per group, depth {depth}: peak {peak} > ring bound {bound}");
        assert_eq!(offloaded.offload.stats().misses, 0);
        peak
    };
    // Without prefetch, the anchor's order, strictly.
    let (leaf, block1, block3) = (leaf_peak(false), block_peak(1, false, 1), block_peak(3, false, 1));
    assert!(
        leaf <= block1 && block1 < block3 && block3 < total,
        "leaf {leaf}, block/1 {block1}, block/3 {block3}, all {total}"
    );
    // With prefetch, one more group in flight: block/3 then holds both halves of the model, as much as resident.
    let (leaf, block1, block3) = (leaf_peak(true), block_peak(1, true, 1), block_peak(3, true, 1));
    assert!(
        leaf <= block1 && block1 < block3 && block3 <= total,
        "leaf {leaf}, block/1 {block1}, block/3 {block3}, all {total}"
    );
    // A deeper prefetch stays within its own bound (checked inside).
    block_peak(1, true, 2);
}

/// The window is what the plan counts whatever the threads' timing: a group leaves the card only once the
/// prefetches of the window hold their bytes. With a worker late by far more than a block's compute, every steady
/// forward still peaks at the resident part plus `1 + depth` groups, exactly (without the wait in `release`, the
/// late prefetch took the bytes the released group gave back, and the peak was one group lower), and every group
/// is still a prefetch hit or a wait, never a miss.
#[test]
fn a_late_prefetch_still_fills_the_window_before_the_group_before_it_leaves() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    for depth in [1, 2] {
        let card = hard_card(GIB);
        let ledger = on_the_worker_ledger(&card, WorkerAct::Sleep(Duration::from_millis(20)));
        let config = config_with(&card, true, ledger).with_prefetch_depth(depth);
        let offloaded = BlockModel::new(model.clone(), config, 1, Residency::Resident);
        let peak = steady_peak(&card, || {
            let out = offloaded.forward(x.clone()).unwrap();
            assert!(max_abs_diff(&out, &expected) <= 1e-6);
        });
        let window = (depth as u64 + 1) * offloaded.offload.largest_group();
        let bound = offloaded.offload.resident_bytes() + window;
        assert_eq!(peak, bound, "depth {depth}: the peak is the resident part plus the whole window");
        assert_eq!(offloaded.offload.stats().misses, 0, "depth {depth}: {:?}", offloaded.offload.stats());
    }
}

#[test]
fn steady_runs_have_no_misses_and_every_group_is_a_prefetch_hit() {
    let device = Device::flex();
    let card = slow_card(GIB, Duration::from_millis(2));
    let offloaded = BlockModel::new(Model::new(&device), config(&card, true), 1, Residency::Resident);
    let x = input(&device);
    offloaded.forward(x.clone()).unwrap();
    assert!(!offloaded.offload.is_capturing(), "the top runs twice per forward, so the first forward ends the capture");
    for _ in 0..4 {
        offloaded.forward(x.clone()).unwrap();
    }
    let stats = offloaded.offload.stats();
    assert_eq!(stats.misses, 0, "{stats:?}");
    assert_eq!(
        stats.onloads,
        1 + BLOCKS as u64,
        "only the resident top and the capture pass load synchronously: {stats:?}"
    );
    assert_eq!(stats.prefetch_hits + stats.prefetch_waits, 4 * BLOCKS as u64, "{stats:?}");
    assert_eq!(stats.unused_prefetches, 0);
}

/// Every upload, synchronous or prefetched, is timed by the clock: the link rate counts each one once, with the
/// bytes the stats count, and its 10th percentile is never above its median.
#[test]
fn every_upload_is_timed_and_the_link_rate_counts_each_once() {
    let device = Device::flex();
    let card = slow_card(GIB, Duration::from_millis(1));
    let offloaded = BlockModel::new(Model::new(&device), config(&card, true), 1, Residency::Resident);
    let x = input(&device);
    for _ in 0..3 {
        offloaded.forward(x.clone()).unwrap();
    }
    // The last forward's wrapped prefetch may still be in flight: every upload counted has ended.
    offloaded.offload.wait_idle();
    let stats = offloaded.offload.stats();
    let rate = offloaded.offload.link_rate().expect("uploads were made");
    assert_eq!(rate.uploads as u64, stats.onloads + stats.prefetches - stats.failed_prefetches, "{stats:?}");
    assert_eq!(rate.bytes, stats.bytes_onloaded, "{stats:?}");
    assert!(rate.p10 > 0.0 && rate.p10 <= rate.median, "{rate:?}");
    assert!(
        rate.to_string().contains(&format!("measured by the clock: median {}", offload_core::format_rate(rate.median))),
        "{rate}"
    );
}

/// HiDream (diffusers #11307): the caption projections are declared after the blocks but run before them.
#[test]
fn order_comes_from_calls_not_declaration() {
    let device = Device::flex();
    let card = hard_card(GIB);
    let offload = GroupOffload::new(config(&card, true)).unwrap();
    let blocks = offload.blocks("blocks", (0..3).map(|_| Block::new(&device)).collect(), 1).unwrap();
    let caption: Vec<Linear> =
        (0..2).map(|_| burn::nn::LinearConfig::new(common::DIM, common::DIM).init(&device)).collect();
    let caption = offload.blocks("caption_projection", caption, 1).unwrap();
    let reference_caption: Vec<Linear> = (0..2).map(|k| caption.group(k).unwrap()[0].clone()).collect();
    let reference_blocks: Vec<Block> = (0..3).map(|k| blocks.group(k).unwrap()[0].clone()).collect();
    offload.recapture();
    let x = input(&device);
    let expected = {
        let mut x = x.clone();
        for c in &reference_caption {
            x = c.forward(x);
        }
        for b in &reference_blocks {
            x = b.forward(x);
        }
        x
    };
    let forward = || {
        let mut x = x.clone();
        for group in caption.iter() {
            x = group.unwrap()[0].forward(x);
        }
        for group in blocks.iter() {
            x = group.unwrap()[0].forward(x);
        }
        offload.end_capture();
        x
    };
    for _ in 0..4 {
        assert!(max_abs_diff(&forward(), &expected) <= 1e-6);
    }
    expect_test::expect![[r#"
        [
            "m/caption_projection_0_0",
            "m/caption_projection_1_1",
            "m/blocks_0_0",
            "m/blocks_1_1",
            "m/blocks_2_2",
        ]
    "#]]
    .assert_debug_eq(&offload.order());
    assert_eq!(offload.stats().misses, 0, "{:?}", offload.stats());
}

/// Helios (diffusers #13211): a conditional module absent on the first pass.
#[test]
fn a_group_first_seen_after_capture_is_a_miss_once_then_prefetched() {
    let device = Device::flex();
    let card = hard_card(GIB);
    let offload = GroupOffload::new(config(&card, true)).unwrap();
    let blocks = offload.blocks("blocks", (0..4).map(|_| Block::new(&device)).collect(), 1).unwrap();
    let extra = offload.module("extra", Block::new(&device), Residency::Streamed).unwrap();
    let x = input(&device);
    let forward = |with_extra: bool| {
        offload
            .run(|| {
                let mut x = x.clone();
                for (k, group) in blocks.iter().enumerate() {
                    x = group?[0].forward(x);
                    if with_extra && k == 1 {
                        x = extra.get()?.forward(x);
                    }
                }
                Ok::<_, Error>(x)
            })
            .unwrap()
    };
    forward(false);
    forward(false);
    assert_eq!(offload.stats().misses, 0);
    let first = forward(true);
    assert_eq!(offload.stats().misses, 1, "{:?}", offload.stats());
    assert_eq!(offload.stats().order_inserts, 1);
    let second = forward(true);
    let third = forward(true);
    assert_eq!(offload.stats().misses, 1, "{:?}", offload.stats());
    assert_eq!(first.to_data(), second.to_data());
    assert_eq!(second.to_data(), third.to_data());
    assert_eq!(offload.order()[2], "m/extra");
}

#[test]
fn failed_upload_keeps_the_host_copy_and_allocates_nothing() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    for fail_transfer in [false, true] {
        let card = hard_card(GIB);
        let offloaded = BlockModel::new(model.clone(), config(&card, false), 1, Residency::Resident);
        // Resident parts upload when the model is onloaded (or first used), never while it is built.
        assert_eq!(card.stats().allocations, 0, "building the offloader allocates nothing");
        offloaded.offload.onload_resident().unwrap();
        let before = offloaded.offload.host_checksums();
        let allocated = card.allocated();
        // The top is resident (1 allocation); fail the first block's upload.
        let next = card.stats().allocations + 1;
        if fail_transfer {
            common::fail_transfer(&card, 2);
        } else {
            common::fail_allocation(&card, next);
        }
        let err = offloaded.forward(x.clone()).unwrap_err();
        assert!(matches!(err, Error::Onload { ref group, .. } if group == "m/blocks_0_0"), "{err}");
        assert_eq!(err.is_out_of_memory(), !fail_transfer);
        assert!(err.to_string().contains("the host copy is intact"), "{err}");
        assert_eq!(card.allocated(), allocated, "nothing stays allocated");
        assert_eq!(offloaded.offload.host_checksums(), before, "host copy unchanged");
        // The next run works and gives the right answer.
        let out = offloaded.forward(x.clone()).unwrap();
        assert!(max_abs_diff(&out, &expected) <= 1e-6);
    }
}

/// The test model at block level, one block a group with prefetch, on a 1 GiB hard card: its input, the resident
/// model's output for it, the card and the offloaded model.
fn prefetched_blocks() -> (Tensor<2>, Tensor<2>, Arc<SimCard>, BlockModel) {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    let card = hard_card(GIB);
    let offloaded = BlockModel::new(model, config(&card, true), 1, Residency::Resident);
    (x, expected, card, offloaded)
}

#[test]
fn a_failed_prefetch_falls_back_to_a_synchronous_onload() {
    let (x, expected, card, offloaded) = prefetched_blocks();
    offloaded.forward(x.clone()).unwrap();
    common::fail_allocation(&card, card.stats().allocations + 2);
    for _ in 0..2 {
        let out = offloaded.forward(x.clone()).unwrap();
        assert!(max_abs_diff(&out, &expected) <= 1e-6);
    }
    let stats = offloaded.offload.stats();
    assert_eq!(stats.failed_prefetches, 1, "{stats:?}");
    assert_eq!(stats.misses, 1, "{stats:?}");
}

#[test]
fn every_move_is_on_the_ledger_and_in_the_record() {
    let device = Device::flex();
    let card = hard_card(GIB);
    let record = OffloadRecord::new();
    let offload = GroupOffload::new(config(&card, false).with_record(record.clone())).unwrap();
    let blocks = offload.blocks("blocks", (0..2).map(|_| Block::new(&device)).collect(), 1).unwrap();
    for _ in 0..2 {
        for group in blocks.iter() {
            drop(group.unwrap());
        }
    }
    let lines: Vec<String> = record
        .events()
        .iter()
        .map(|e| {
            format!(
                "{} {} {} {}",
                e.action,
                e.id,
                e.bytes,
                e.reason.as_ref().map(ToString::to_string).unwrap_or_default()
            )
        })
        .collect();
    expect_test::expect![[r#"
        [
            "onload m/blocks_0_0 4416 group_onload",
            "offload m/blocks_0_0 4416 group_offload",
            "onload m/blocks_1_1 4416 group_onload",
            "offload m/blocks_1_1 4416 group_offload",
            "onload m/blocks_0_0 4416 group_onload",
            "offload m/blocks_0_0 4416 group_offload",
            "onload m/blocks_1_1 4416 group_onload",
            "offload m/blocks_1_1 4416 group_offload",
        ]
    "#]]
    .assert_debug_eq(&lines);
    assert_eq!(card.allocated(), 0);
    let calls: Vec<String> = card.log().iter().take(3).map(ToString::to_string).collect();
    assert_eq!(calls, ["allocate 4416", "transfer 4416", "free 4416"]);
    // Readings come from the card: the second onload saw the first group freed, and the peak of one group.
    let events = record.events();
    assert_eq!(events[2].available, Some(GIB));
    assert_eq!(events[2].peak, Some(4416));

    // With prefetch the worker's uploads are recorded as `prefetch`.
    let record = OffloadRecord::new();
    let offload = GroupOffload::new(config(&card, true).with_record(record.clone())).unwrap();
    let blocks = offload.blocks("blocks", (0..3).map(|_| Block::new(&device)).collect(), 1).unwrap();
    for _ in 0..3 {
        offload.run(|| blocks.iter().try_for_each(|group| group.map(drop))).unwrap();
    }
    offload.wait_idle();
    let events = record.events();
    assert!(events.iter().any(|e| e.reason == Some(Reason::Prefetch) && e.action == Action::Onload));
    assert!(events.iter().all(|e| e.id.starts_with("m/blocks_")));
}

#[test]
fn several_blocks_per_group_prefetch_correctly() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    let card = slow_card(GIB, Duration::from_millis(1));
    let offloaded = BlockModel::new(model, config(&card, true), 2, Residency::Resident);
    assert_eq!(offloaded.blocks.num_groups(), 3);
    assert_eq!(offloaded.blocks.blocks_of(1), 2..4);
    for _ in 0..4 {
        assert!(max_abs_diff(&offloaded.forward(x.clone()).unwrap(), &expected) <= 1e-6);
    }
    assert_eq!(offloaded.offload.stats().misses, 0);
}

#[test]
fn streamed_top_level_and_resident_budget() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    let card = hard_card(GIB);
    let offloaded = BlockModel::new(model.clone(), config(&card, true), 1, Residency::Streamed);
    assert_eq!(card.allocated(), 0, "a streamed top is not uploaded up front");
    for _ in 0..3 {
        assert!(max_abs_diff(&offloaded.forward(x.clone()).unwrap(), &expected) <= 1e-6);
    }
    // The top runs twice per forward (pre and post): the capture is the whole first forward, so both takes are
    // steps of the order from the start, with no miss and nothing learnt late.
    let stats = offloaded.offload.stats();
    assert_eq!((stats.misses, stats.order_inserts), (0, 0), "{stats:?}");
    for _ in 0..3 {
        assert!(max_abs_diff(&offloaded.forward(x.clone()).unwrap(), &expected) <= 1e-6);
    }
    assert_eq!(offloaded.offload.stats().misses, 0, "{:?}", offloaded.offload.stats());
    assert_eq!(offloaded.offload.order().iter().filter(|id| *id == "m/top").count(), 2);

    // A budget of two blocks keeps the first two released blocks on the device for good.
    let card = hard_card(GIB);
    let block_bytes = 4416;
    let offloaded =
        BlockModel::new(model, config(&card, false).with_resident_budget(2 * block_bytes), 1, Residency::Resident);
    offloaded.forward(x.clone()).unwrap();
    offloaded.forward(x.clone()).unwrap();
    let on_device = offloaded.offload.on_device();
    assert_eq!(on_device, ["m/blocks_0_0", "m/blocks_1_1", "m/top"]);
}

#[test]
fn the_pinned_budget_pins_streamed_groups_in_order_and_their_uploads_are_pinned_copies() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    let probe = BlockModel::new(model.clone(), config(&hard_card(GIB), false), 1, Residency::Resident);
    let groups = probe.offload.groups();
    let block = groups.iter().find(|(id, _)| id == "m/blocks_0_0").map(|(_, b)| *b).unwrap();
    let streamed: u64 = groups.iter().filter(|(id, _)| id.starts_with("m/blocks")).map(|(_, b)| b).sum();

    // Room for two and a half blocks: the first two blocks in registration order are pinned.
    let card = hard_card(GIB);
    let offloaded =
        BlockModel::new(model.clone(), config(&card, false).with_pinned_budget(block * 5 / 2), 1, Residency::Resident);
    let (pinned, page_locked) = offloaded.offload.pinned_bytes();
    assert_eq!(pinned, 2 * block);
    assert_eq!(page_locked, 0, "the CPU backend has no page-locked memory");
    for pass in 0..3 {
        let diff = max_abs_diff(&offloaded.forward(x.clone()).unwrap(), &expected);
        assert!(diff <= 1e-6, "pass {pass}: {diff}");
    }
    // Without prefetch every forward uploads each streamed group once: the two pinned ones as pinned copies.
    assert_eq!(card.stats().bytes_pinned_to_device, 3 * 2 * block);

    // A budget larger than the model pins every streamed group, never the resident top layers.
    let card = hard_card(GIB);
    let offloaded = BlockModel::new(model, config(&card, false).with_pinned_budget(u64::MAX), 1, Residency::Resident);
    assert_eq!(offloaded.offload.pinned_bytes().0, streamed);
    offloaded.forward(x).unwrap();
    assert_eq!(card.stats().bytes_pinned_to_device, streamed);
}

#[test]
fn disk_store_writes_one_file_per_group_and_reuses_only_same_content() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    let dir = std::env::temp_dir().join(format!("group-offload-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let card = hard_card(GIB);
    let files = {
        let offloaded =
            BlockModel::new(model.clone(), config(&card, true).with_disk_store(&dir), 1, Residency::Resident);
        for _ in 0..3 {
            assert!(max_abs_diff(&offloaded.forward(x.clone()).unwrap(), &expected) <= 1e-6);
        }
        offloaded.offload.disk_files()
    };
    assert_eq!(files.len(), BLOCKS + 1);
    let mut on_disk: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    on_disk.sort();
    let mut sorted = files.clone();
    sorted.sort();
    assert_eq!(on_disk, sorted);
    assert!(files.iter().all(|f| f.file_name().unwrap().to_string_lossy().starts_with("m-")));
    let modified = std::fs::metadata(&files[0]).unwrap().modified().unwrap();

    // Same content: the files are reused, not rewritten.
    std::thread::sleep(Duration::from_millis(20));
    let again = BlockModel::new(model.clone(), config(&card, false).with_disk_store(&dir), 1, Residency::Resident);
    assert_eq!(again.offload.disk_files(), files);
    assert_eq!(std::fs::metadata(&files[0]).unwrap().modified().unwrap(), modified);

    // A file corrupted under the content's name is detected and rewritten, never trusted.
    std::fs::write(&files[0], b"not a safetensors file").unwrap();
    let repaired = BlockModel::new(model.clone(), config(&card, false).with_disk_store(&dir), 1, Residency::Resident);
    assert!(max_abs_diff(&repaired.forward(x.clone()).unwrap(), &expected) <= 1e-6);

    // Different content gets different files.
    let other = BlockModel::new(
        Model::new(&device).clone_with_offset(),
        config(&card, false).with_disk_store(&dir),
        1,
        Residency::Resident,
    );
    assert!(other.offload.disk_files().iter().all(|f| !files.contains(f)));
    let _ = std::fs::remove_dir_all(&dir);
}

trait Offset {
    fn clone_with_offset(self) -> Self;
}

impl Offset for Model {
    fn clone_with_offset(self) -> Self {
        let mut model = self;
        model.pre.weight = model.pre.weight.map(|w| w + 1.0);
        for block in &mut model.blocks {
            block.fc1.weight = block.fc1.weight.clone().map(|w| w + 1.0);
        }
        model
    }
}

#[test]
fn a_group_offloaded_model_is_never_evicted_by_auto_offload() {
    use offload_core::ComponentError;

    /// A plain component of a given size.
    struct Plain {
        bytes: u64,
        device: DeviceName,
    }
    impl Offloadable for Plain {
        fn bytes(&self) -> u64 {
            self.bytes
        }
        fn device(&self) -> DeviceName {
            self.device.clone()
        }
        fn onload(&mut self, d: &DeviceName) -> Result<(), ComponentError> {
            self.device = d.clone();
            Ok(())
        }
        fn offload(&mut self) -> Result<(), ComponentError> {
            self.device = DeviceName::cpu();
            Ok(())
        }
    }

    let device = Device::flex();
    let card = hard_card(64 * 1024);
    let offloaded = BlockModel::new(Model::new(&device), config(&card, true), 1, Residency::Resident);
    let adapter = GroupOffloadedModel::new(offloaded.offload.clone());
    assert!(!adapter.evictable());
    assert_eq!(adapter.resident_bytes(), offloaded.offload.resident_bytes());
    assert!(adapter.resident_bytes() < adapter.bytes());

    let manager = ComponentsManager::new();
    let transformer = manager.add("transformer", adapter, None).unwrap();
    let a = manager.add("text_encoder", Plain { bytes: 40 * 1024, device: DeviceName::cpu() }, None).unwrap();
    let b = manager.add("vae", Plain { bytes: 40 * 1024, device: DeviceName::cpu() }, None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    let x = input(&device);
    manager
        .run(&transformer, |m: &mut GroupOffloadedModel| {
            assert_eq!(m.device().as_str(), "cuda:0");
            offloaded.forward(x.clone()).map_err(ComponentError::from)
        })
        .unwrap();
    for _ in 0..3 {
        manager.run_any(&a, |_| Ok(())).unwrap();
        manager.run_any(&b, |_| Ok(())).unwrap();
    }
    let record = manager.offload_record();
    assert!(
        record.events().iter().all(|e| !(e.id == transformer && e.action == Action::Offload)),
        "the group-offloaded model was evicted:\n{record}"
    );
    assert!(manager.placement().iter().any(|(id, d)| *id == transformer && d.as_str() == "cuda:0"));

    // The adapter refuses a device it was not prepared for.
    let mut wrong = GroupOffloadedModel::new(offloaded.offload.clone());
    let err = wrong.onload(&DeviceName::parse("cuda:1").unwrap()).unwrap_err();
    assert!(err.to_string().contains("was prepared for cuda:0, but it was run on cuda:1"), "{err}");
}

#[test]
fn invalid_configuration_is_a_typed_error() {
    let device = Device::flex();
    let card = hard_card(GIB);
    let err = GroupOffload::new(config(&card, true).with_prefetch_depth(0)).unwrap_err();
    assert!(err.to_string().contains("prefetch_depth is 0"), "{err}");
    let offload = GroupOffload::new(config(&card, true)).unwrap();
    let err = offload.blocks("blocks", vec![Block::new(&device)], 0).unwrap_err();
    assert!(err.to_string().contains("num_blocks_per_group"), "{err}");
    offload.blocks("blocks", vec![Block::new(&device)], 1).unwrap();
    let err = offload.blocks("blocks", vec![Block::new(&device)], 1).unwrap_err();
    assert!(err.to_string().contains("already added"), "{err}");
    let leaf = offload.leaves("leafy", Model::new(&device), &LeafPredicate::default()).unwrap();
    let err = leaf.group("nope").unwrap_err();
    assert!(matches!(err, Error::UnknownGroup { .. }), "{err}");
    offload.ensure_device(&device).unwrap();
}

/// The overlap bench measures what its name says: its prefetch run prefetches every group of every steady
/// forward (it once iterated the parts outside `GroupOffload::run`, so the capture never ended, nothing was
/// prefetched, and "prefetch" measured serial streaming: efficiency 0.51 against 0.50 serial). Counts, not
/// times, so it runs by default.
#[test]
fn the_overlap_bench_prefetches_every_group_of_every_steady_forward() {
    let config = group_offload::bench::OverlapConfig {
        groups: 4,
        dim: 16,
        rows: 4,
        matmuls_per_group: 1,
        transfer: Some(Duration::ZERO),
        forwards: 3,
        prefetch_depth: 1,
    };
    let report = group_offload::bench::overlap_benchmark(config).unwrap();
    // One prefetch per group per steady forward (the capture's end sends the first one's first group, and each
    // forward's last take sends the next one's), and the one the last forward sends for a forward not made.
    assert_eq!(report.prefetches, 3 * 4 + 1, "{report}");
    assert_eq!(report.prefetch_misses, 0, "{report}");
}

/// Parts driven without `GroupOffload::run` stay capturing: nothing is prefetched, every output is still the
/// resident model's, and the captured order stops growing at 64 takes per group instead of by one step a take for
/// as long as the model runs. `recapture` forgets that order, and forwards wrapped in `run` capture and prefetch.
#[test]
fn a_capture_no_run_ends_stops_growing_and_run_starts_the_prefetches() {
    let (x, expected, _, offloaded) = prefetched_blocks();
    let groups = offloaded.offload.groups().len();
    let forwards = 64 * groups / (BLOCKS + 2) + 2;
    for _ in 0..forwards {
        let out = offloaded.forward_once(x.clone()).unwrap();
        assert!(max_abs_diff(&out, &expected) <= 1e-6);
    }
    assert!(offloaded.offload.is_capturing());
    assert_eq!(offloaded.offload.stats().prefetches, 0);
    assert_eq!(offloaded.offload.order().len(), 64 * groups, "the order stopped growing at the limit");
    offloaded.offload.recapture();
    offloaded.forward(x.clone()).unwrap();
    offloaded.forward(x.clone()).unwrap();
    assert_eq!(offloaded.offload.order().len(), BLOCKS + 2, "one forward's takes: the top twice and each block");
    assert!(offloaded.offload.stats().prefetches > 0, "{:?}", offloaded.offload.stats());
}

/// Timing-sensitive, so not part of the default run: `cargo test -p group-offload -- --ignored overlap`.
#[test]
#[ignore = "timing-dependent: run `cargo xtask bench overlap` or `cargo test -p group-offload -- --ignored overlap`"]
fn overlap_prefetch_hides_transfers() {
    let report = group_offload::bench::overlap_benchmark(group_offload::bench::OverlapConfig::default()).unwrap();
    println!("{report}");
    assert_eq!(report.prefetch_misses, 0);
    assert!(report.prefetch_efficiency > report.serial_efficiency, "{report}");
}

#[test]
fn the_timeline_holds_each_groups_upload_compute_and_release_prefetches_on_the_worker() {
    use offload_core::Timeline;
    use offload_core::timeline::{EventKind, category};

    let device = Device::flex();
    let card = hard_card(GIB);
    let timeline = Timeline::enabled();
    let model = BlockModel::new(
        Model::new(&device),
        config(&card, true).with_timeline(timeline.clone()),
        1,
        Residency::Resident,
    );
    let x = input(&device);
    for _ in 0..3 {
        model.forward(x.clone()).unwrap();
    }
    model.offload.wait_idle();
    let events = timeline.events();
    let spans = |kind: &'static str| {
        events.iter().filter(move |e| e.category == kind && matches!(e.kind, EventKind::Span { .. }))
    };
    let stats = model.offload.stats();
    let caller = spans(category::COMPUTE).next().unwrap().thread;
    assert!(spans(category::COMPUTE).all(|e| e.thread == caller));
    // One upload span per upload, synchronous ones on the caller, prefetches on the worker thread.
    let (on_caller, on_worker): (Vec<_>, Vec<_>) = spans(category::UPLOAD).partition(|e| e.thread == caller);
    assert_eq!(on_caller.len() as u64, stats.onloads);
    assert_eq!(on_worker.len() as u64, stats.prefetches);
    assert!(stats.prefetches > 0);
    let worker = on_worker[0].thread;
    let name = timeline.threads().into_iter().find(|t| t.tid == worker).unwrap().name;
    assert_eq!(name, "group-offload-m");
    assert_eq!(spans(category::RELEASE).count() as u64, stats.offloads);
    // Three forwards of (1 resident top taken twice + each block group) computes.
    assert_eq!(spans(category::COMPUTE).count(), 3 * (2 + BLOCKS));
    // A sample after every upload and release, within what the card held.
    let samples = timeline.memory_samples();
    assert_eq!(samples.len() as u64, stats.onloads + stats.prefetches + stats.offloads);
    assert!(samples.iter().all(|s| s.allocated <= card.peak()));
}

/// A ledger over the card that first hands each request for room to `act` (`allocate_tensors`, the one every
/// upload makes), which may wait, panic or refuse; every other call, and every request `act` lets through, goes to
/// the card.
struct Acting<F> {
    card: Arc<SimCard>,
    act: F,
}

impl<F> offload_core::DeviceLedger for Acting<F>
where
    F: Fn(&[u64]) -> Result<(), offload_core::ComponentError> + Send + Sync,
{
    fn allocate(&self, bytes: u64) -> Result<(), offload_core::ComponentError> {
        self.card.allocate(bytes)
    }

    fn free(&self, bytes: u64) {
        self.card.free(bytes)
    }

    fn allocate_tensors(&self, sizes: &[u64]) -> Result<(), offload_core::ComponentError> {
        (self.act)(sizes)?;
        self.card.allocate_tensors(sizes)
    }

    fn free_tensors(&self, sizes: &[u64]) {
        self.card.free_tensors(sizes)
    }

    fn transfer(&self, bytes: u64, direction: offload_core::Direction) -> Result<(), offload_core::ComponentError> {
        self.card.transfer(bytes, direction)
    }
}

/// Whether this thread is a prefetch worker (the engine's own, or its device's upload thread).
fn on_the_worker() -> bool {
    std::thread::current().name().is_some_and(|name| name.starts_with("group-offload-"))
}

/// What [`on_the_worker_ledger`] does when a prefetch worker asks it for room.
#[derive(Clone, Copy)]
enum WorkerAct {
    /// Waits this long first: every prefetch is late.
    Sleep(Duration),
    /// Panics: a ledger bug on the worker.
    Panic,
}

/// A ledger that acts on a prefetch worker's requests for room, and defers to the card on every other thread.
fn on_the_worker_ledger(card: &Arc<SimCard>, act: WorkerAct) -> Arc<dyn offload_core::DeviceLedger> {
    Arc::new(Acting {
        card: card.clone(),
        act: move |_: &[u64]| {
            if on_the_worker() {
                match act {
                    WorkerAct::Sleep(delay) => std::thread::sleep(delay),
                    WorkerAct::Panic => panic!("a ledger bug on the prefetch worker"),
                }
            }
            Ok(())
        },
    })
}

/// Three forwards of the block model whose ledger panics on the prefetch worker, at prefetch depth `depth`, on a
/// thread of their own: a forward that waits for a prefetch that will never arrive fails the test at its deadline
/// instead of stalling the suite. Returns each forward's largest difference from the resident model, and the stats.
fn forwards_with_a_panicking_worker(depth: usize) -> (Vec<f32>, group_offload::engine::GroupStats) {
    within_deadline("a forward waited for a prefetch that was never going to arrive, or panicked", move || {
        let device = Device::flex();
        let model = Model::new(&device);
        let x = input(&device);
        let expected = model.forward(x.clone());
        let card = hard_card(GIB);
        let config = config_with(&card, true, on_the_worker_ledger(&card, WorkerAct::Panic)).with_prefetch_depth(depth);
        let offloaded = BlockModel::new(model, config, 1, Residency::Resident);
        let diffs: Vec<f32> = (0..3).map(|_| max_abs_diff(&offloaded.forward(x.clone()).unwrap(), &expected)).collect();
        offloaded.offload.wait_idle();
        (diffs, offloaded.offload.stats())
    })
}

/// Runs `f` on a thread of its own and returns what it returns, failing with `what` if that takes over 60 s (or
/// `f` panics): a test of a hang fails at the deadline instead of stalling the suite.
fn within_deadline<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(f());
    });
    finished.recv_timeout(std::time::Duration::from_secs(60)).expect(what)
}

/// A prefetch whose upload panics outside the device's own operations (here in a ledger, at every request the
/// worker makes) fails typed, as a `prefetch_failed` row, and leaves no group loading for ever: the group goes back
/// offloaded, the forward that takes it loads it itself, and every output is the resident model's.
#[test]
fn a_panicking_prefetch_leaves_its_group_offloaded_and_the_forward_loads_it() {
    let (diffs, stats) = forwards_with_a_panicking_worker(1);
    assert!(diffs.iter().all(|d| *d <= 1e-6), "{diffs:?}");
    assert!(stats.failed_prefetches >= 1, "{stats:?}");
    assert_eq!(stats.prefetch_hits, 0, "{stats:?}");
    assert!(stats.misses > 0, "the groups were loaded when taken: {stats:?}");
}

/// Prefetches queued behind one whose upload panics still run: the worker catches the panic and goes on, and each
/// of them (here panicking in turn) gives its group back, so the forward that takes the group loads it itself
/// instead of waiting for ever. With depth 2 the capture's end queues two prefetches at once, so the second is
/// almost always still in the channel when the first panics (when the panic ended the worker's thread, this hung
/// every time it ran here until each dropped job gave its group back).
#[test]
fn prefetches_queued_behind_a_panicking_one_give_their_groups_back() {
    let (diffs, stats) = forwards_with_a_panicking_worker(2);
    assert!(diffs.iter().all(|d| *d <= 1e-6), "{diffs:?}");
    // Both queued prefetches failed: the one that panicked first and the one behind it.
    assert!(stats.failed_prefetches >= 2, "{stats:?}");
    assert_eq!(stats.prefetch_hits, 0, "{stats:?}");
}

/// A take whose upload the device refuses gives back the prefetches nobody borrows and tries once more; one the
/// worker is still copying is waited for first, then given back. The capture's end queues the next forward's first
/// block, and the forward's resident top queues the second behind it (depth 2): the first is refused while the
/// forward waits for it, so the forward loads it itself, while the worker copies the second (30 ms a transfer
/// here). The device refuses that take too: without the wait the second group was still in flight, nothing was
/// idle to give back, and the forward failed with the worker's group on the card.
#[test]
fn a_refused_take_waits_for_the_prefetch_in_flight_then_gives_it_back_and_loads() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    let card = slow_card(GIB, Duration::from_millis(30));
    let record = OffloadRecord::new();
    // The ledger refuses the first prefetch the worker asks room for (100 ms late), then the calling thread's next
    // upload, once each, as a full device would. Its step: 0, nothing refused yet; 1, the prefetch was refused; 2,
    // the take was refused too.
    let step = Arc::new(std::sync::Mutex::new(0u8));
    let refuses = step.clone();
    let ledger = Acting {
        card: card.clone(),
        act: move |sizes: &[u64]| {
            let on_worker = on_the_worker();
            let mut step = refuses.lock().unwrap();
            if (*step == 0 && on_worker) || (*step == 1 && !on_worker) {
                if on_worker {
                    // Late, so that the forward is already waiting for this group: refused now, it is loaded by
                    // the forward itself rather than prefetched again by an earlier take.
                    std::thread::sleep(Duration::from_millis(100));
                }
                *step += 1;
                let (device, requested) = (DeviceName::parse("cuda").unwrap(), sizes.iter().sum());
                return Err(offload_core::ComponentError::OutOfMemory { device, requested, available: 0 });
            }
            Ok(())
        },
    };
    let config = config_with(&card, true, Arc::new(ledger)).with_prefetch_depth(2).with_record(record.clone());
    let offloaded = BlockModel::new(model, config, 1, Residency::Resident);
    for forward in 0..3 {
        let out = offloaded.forward(x.clone()).unwrap_or_else(|e| panic!("forward {forward}: {e}"));
        assert!(max_abs_diff(&out, &expected) <= 1e-6, "forward {forward}");
    }
    offloaded.offload.wait_idle();
    assert_eq!(*step.lock().unwrap(), 2, "the prefetch and then the take were refused");
    let stats = offloaded.offload.stats();
    assert_eq!(stats.failed_prefetches, 1, "{stats:?}");
    // The group in flight was given back because the take ran out, and came back as a prefetch later.
    let given_back: Vec<_> = record
        .events()
        .into_iter()
        .filter(|e| e.action == Action::Offload && e.reason == Some(Reason::OomRetry("m".into())))
        .map(|e| e.id)
        .collect();
    assert_eq!(given_back, ["m/blocks_1_1"], "{stats:?}");
}

/// A synchronous upload that panics on the calling thread (here in a ledger, during the capture's loads) stays a
/// panic, and leaves its group offloaded, not `Loading`: the next forward loads it and matches the resident model
/// instead of waiting for ever (run under a deadline, so a hang fails the test).
#[test]
fn a_synchronous_upload_that_panics_leaves_its_group_offloaded() {
    let what = "a forward waited for a group a panicked upload left loading";
    let (panicked, diffs, on_device) = within_deadline(what, move || {
        let device = Device::flex();
        let model = Model::new(&device);
        let x = input(&device);
        let expected = model.forward(x.clone());
        let card = hard_card(GIB);
        // Panics at its third request for room, on the calling thread (there is no worker without prefetch).
        let requests = std::sync::atomic::AtomicUsize::new(0);
        let ledger = Acting {
            card: card.clone(),
            act: move |_: &[u64]| {
                let request = requests.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                assert_ne!(request, 3, "a ledger bug on the calling thread");
                Ok(())
            },
        };
        let offloaded = BlockModel::new(model, config_with(&card, false, Arc::new(ledger)), 1, Residency::Resident);
        let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| offloaded.forward(x.clone())));
        let diffs: Vec<f32> = (0..2).map(|_| max_abs_diff(&offloaded.forward(x.clone()).unwrap(), &expected)).collect();
        (first.is_err(), diffs, offloaded.offload.on_device())
    });
    assert!(panicked, "the ledger's panic went on to the caller");
    assert!(diffs.iter().all(|d| *d <= 1e-6), "{diffs:?}");
    assert!(!on_device.is_empty(), "the resident top is on the device again");
}

/// A ledger over the card whose transfer panics once, on the thread `panics_on` says, after the upload reserved its
/// room (`allocate_tensors` went through): a ledger bug past the device's own guards.
struct PanicsInATransfer<F> {
    card: Arc<SimCard>,
    panics_on: F,
    panicked: std::sync::atomic::AtomicBool,
}

impl<F: Fn() -> bool + Send + Sync> offload_core::DeviceLedger for PanicsInATransfer<F> {
    fn allocate(&self, bytes: u64) -> Result<(), offload_core::ComponentError> {
        self.card.allocate(bytes)
    }

    fn free(&self, bytes: u64) {
        self.card.free(bytes)
    }

    fn allocate_tensors(&self, sizes: &[u64]) -> Result<(), offload_core::ComponentError> {
        self.card.allocate_tensors(sizes)
    }

    fn free_tensors(&self, sizes: &[u64]) {
        self.card.free_tensors(sizes)
    }

    fn transfer(&self, bytes: u64, direction: offload_core::Direction) -> Result<(), offload_core::ComponentError> {
        if (self.panics_on)() && !self.panicked.swap(true, std::sync::atomic::Ordering::SeqCst) {
            panic!("a ledger bug in a transfer");
        }
        self.card.transfer(bytes, direction)
    }
}

/// Issue 37, item 7: a prefetch whose upload panics after it reserved its room (here in the ledger's transfer, on
/// the worker) gives the reservation back as it unwinds, so the account is what it was; the worker thread catches
/// the panic and goes on, so the next prefetches work; and the failure is reported, as a `prefetch_failed` row of
/// the record and a failed prefetch. Before, the reservation stayed on the card (every later refusal a false
/// out-of-memory) and the worker's thread ended, so every later prefetch failed, silently.
#[test]
fn a_prefetch_that_panics_after_reserving_gives_the_room_back_and_the_worker_goes_on() {
    let (stats, record, leaked, diffs) = within_deadline("a forward waited for a prefetch", move || {
        let device = Device::flex();
        let model = Model::new(&device);
        let x = input(&device);
        let expected = model.forward(x.clone());
        let card = hard_card(GIB);
        let record = OffloadRecord::new();
        let ledger = PanicsInATransfer { card: card.clone(), panics_on: on_the_worker, panicked: Default::default() };
        let config = config_with(&card, true, Arc::new(ledger)).with_record(record.clone());
        let offloaded = BlockModel::new(model, config, 1, Residency::Resident);
        let diffs: Vec<f32> = (0..4).map(|_| max_abs_diff(&offloaded.forward(x.clone()).unwrap(), &expected)).collect();
        offloaded.offload.wait_idle();
        offloaded.offload.offload_all().unwrap();
        (offloaded.offload.stats(), record, card.allocated(), diffs)
    });
    assert!(diffs.iter().all(|d| *d <= 1e-6), "{diffs:?}");
    assert_eq!(leaked, 0, "every reservation was given back once the model left the card");
    assert_eq!(stats.failed_prefetches, 1, "{stats:?}");
    // Every group of the three forwards after the capture came from the worker but the one it failed (a hit, or a
    // wait for a prefetch still in flight when the forward took it).
    let prefetched = stats.prefetch_hits + stats.prefetch_waits;
    assert!(prefetched >= 3 * BLOCKS as u64 - 1, "the worker went on prefetching: {stats:?}");
    let refusals = record.refusals();
    assert_eq!(refusals.len(), 1, "{record}");
    let refusal = &refusals[0];
    assert_eq!((refusal.id.as_str(), &refusal.reason), ("m/blocks_0_0", &Some(Reason::PrefetchFailed)), "{record}");
    assert!(refusal.available.is_some(), "the row has its reading");
}

/// A synchronous upload that panics after it reserved its room (here in the ledger's transfer, on the calling
/// thread, during the capture's loads) stays a panic on that thread, and gives its reservation back as it unwinds:
/// the account is what it was before the forward.
#[test]
fn a_synchronous_upload_that_panics_after_reserving_gives_the_room_back() {
    let device = Device::flex();
    let model = Model::new(&device);
    let x = input(&device);
    let expected = model.forward(x.clone());
    let card = hard_card(GIB);
    let ledger = PanicsInATransfer { card: card.clone(), panics_on: || true, panicked: Default::default() };
    let offloaded = BlockModel::new(model, config_with(&card, false, Arc::new(ledger)), 1, Residency::Resident);
    let before = card.allocated();
    let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| offloaded.forward(x.clone())));
    assert!(first.is_err(), "the ledger's panic went on to the caller");
    assert_eq!(card.allocated(), before, "the panicked upload holds nothing on the card");
    let out = offloaded.forward(x.clone()).unwrap();
    assert!(max_abs_diff(&out, &expected) <= 1e-6);
}

/// A prefetch the device refuses for lack of memory is a `prefetch_refused` row of the record, with its group, its
/// bytes and the reading it was refused on, and the record sums the refusals of a stretch of a run
/// (`refusals_since`) in the one line a program prints after each image.
#[test]
fn a_refused_prefetch_is_a_row_of_the_record_with_its_reading() {
    let (x, expected, card, _) = prefetched_blocks();
    let record = OffloadRecord::new();
    let offloaded = BlockModel::new(
        Model::new(&Device::flex()),
        config(&card, true).with_record(record.clone()),
        1,
        Residency::Resident,
    );
    let model_out = offloaded.forward(x.clone()).unwrap();
    let _ = (model_out, expected);
    let mark = record.total_added();
    common::fail_allocation(&card, card.stats().allocations + 2);
    offloaded.forward(x.clone()).unwrap();
    offloaded.forward(x.clone()).unwrap();
    offloaded.offload.wait_idle();
    assert_eq!(offloaded.offload.stats().failed_prefetches, 1);
    let refusals = record.refusals();
    assert_eq!(refusals.len(), 1, "{record}");
    let refusal = &refusals[0];
    assert_eq!(refusal.action, Action::Refused);
    assert_eq!(refusal.reason, Some(Reason::PrefetchRefused));
    assert!(refusal.id.starts_with("m/blocks_"), "{refusal:?}");
    let group_bytes = offloaded.offload.groups().into_iter().find(|(id, _)| *id == refusal.id).unwrap().1;
    assert_eq!(refusal.bytes, group_bytes);
    assert!(refusal.available.is_some() && refusal.peak.is_some(), "{refusal:?}");
    let summary = record.refusals_since(mark).expect("one refusal since the mark");
    assert_eq!((summary.count, summary.failed, summary.bytes), (1, 0, group_bytes));
    assert!(summary.to_string().starts_with("1 prefetch refused (m 1;"), "{summary}");
    assert!(record.refusals_since(record.total_added()).is_none());
}
