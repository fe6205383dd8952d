//! Presets applied to the whole pipeline: the tiny checkpoint under every preset on a hard simulated card too
//! small for what the flow holds without offload gives the resident run's image; plans explain every component;
//! generation runs in three timed phases; capacity profiles round-trip and warn; named calibration reuses the
//! budget it measured.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use group_offload::OffloadDevice;
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::DeviceMemory;
use offload_core::plan::{HostMemory, Outcome, Preset, Route, Settings, SettingsLayer, WarningKind};
use pipeline_zimage::pipeline::{GenerateOptions, PHASES, ZImagePipeline};
use pipeline_zimage::presets::{
    PipelinePlan, check_capacity, component_specs, enable_offload, enable_pipeline_offload, exact_reserve,
    generate_profiled, run_workload,
};

mod common;

use common::{load_tiny as load, max_abs_diff, turbo_options, values};

fn resident_image(opts: &GenerateOptions) -> Vec<f32> {
    let placement = OffloadDevice::host_only();
    values(load(placement).generate(opts, &mut |_, _| {}).expect("resident run"))
}

/// A plentiful, fixed host, so plans do not depend on the machine running the tests.
fn host() -> HostMemory {
    HostMemory::new(64 << 30, 60 << 30)
}

/// A hard simulated card of `bytes` (no context overhead) and the pipeline loaded onto it.
fn on_card(bytes: u64) -> (ZImagePipeline, Arc<SimCard>) {
    let spec = CardSpec::parse(&bytes.to_string()).expect("a size").with_mode(Mode::Hard).with_context_overhead(0);
    let card = SimCard::new(spec);
    let placement = OffloadDevice::simulated(card.clone());
    (load(placement), card)
}

/// What sizes the cards: the components' weights, the transformer's blocks, and the activation estimates.
struct Sizes {
    text_encoder: u64,
    transformer: u64,
    vae: u64,
    outside: u64,
    largest_block: u64,
    reserve: u64,
}

fn sizes(opts: &GenerateOptions) -> Sizes {
    let (probe, _) = on_card(1 << 30);
    let specs = component_specs(&probe, opts).expect("specs");
    let weight = |name: &str| specs.iter().find(|s| s.name == name).map(|s| s.weight_bytes).expect("a component");
    let layout = specs
        .iter()
        .find(|s| s.name == "transformer")
        .and_then(|s| s.layout.clone())
        .expect("the transformer has blocks");
    Sizes {
        text_encoder: weight("text_encoder"),
        transformer: weight("transformer"),
        vae: weight("vae"),
        outside: layout.outside_bytes,
        largest_block: layout.block_bytes.iter().copied().max().unwrap_or(0),
        reserve: exact_reserve(&probe, opts),
    }
}

impl Sizes {
    /// Too small for the transformer whole beside its activations, and far too small for everything at once:
    /// the transformer must stream. Room for its outside bytes, a prefetch window of two blocks, a little
    /// resident budget and the activations.
    fn streaming_card(&self) -> u64 {
        let card = self.outside + 3 * self.largest_block + self.reserve;
        assert!(card < self.transformer + self.reserve, "the transformer would fit whole");
        assert!(card >= self.text_encoder.max(self.vae) + self.reserve, "the encoders would not fit");
        card
    }

    /// Room for any one component whole beside the activations, not for all of them at once.
    fn component_card(&self) -> u64 {
        let card = self.transformer + self.reserve + self.vae / 2;
        assert!(card < self.text_encoder + self.transformer + self.vae + self.reserve);
        card
    }
}

static SCRATCH: AtomicUsize = AtomicUsize::new(0);

/// A fresh directory under the system's temporary directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let n = SCRATCH.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("pipeline-zimage-presets-{name}-{}-{n}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// Settings as a program passes them: `pairs` explicitly, no environment, no file.
fn settings(pairs: &[(&str, String)]) -> Settings {
    let mut explicit = SettingsLayer::default();
    for (key, value) in pairs {
        explicit.set(key, value).unwrap_or_else(|e| panic!("{key}={value}: {e}"));
    }
    Settings::resolve(&explicit, std::iter::empty::<(String, String)>(), None).expect("valid settings")
}

fn plan_on(
    card_bytes: u64,
    pairs: &[(&str, String)],
    opts: &GenerateOptions,
) -> (ZImagePipeline, Arc<SimCard>, pipeline_zimage::Result<PipelinePlan>) {
    let (mut pipeline, card) = on_card(card_bytes);
    let facts = card.device_facts(host());
    let plan = enable_pipeline_offload(&mut pipeline, settings(pairs), &facts, opts);
    (pipeline, card, plan)
}

#[test]
fn every_preset_gives_the_resident_image_on_a_card_that_must_stream_the_transformer() {
    let (opts, golden_image) = turbo_options();
    let resident = resident_image(&opts);
    assert!(max_abs_diff(&resident, &golden_image) <= 1e-3);
    let sizes = sizes(&opts);
    let card_bytes = sizes.streaming_card();
    for preset in Preset::ALL {
        let scratch = Scratch::new("preset");
        let pairs = [
            ("preset", preset.name().to_string()),
            ("reserve", sizes.reserve.to_string()),
            ("profile_dir", scratch.0.display().to_string()),
        ];
        let (pipeline, card, plan) = plan_on(card_bytes, &pairs, &opts);
        if preset == Preset::Off {
            let err = plan.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(
                err.starts_with("cannot apply preset off to text_encoder: route `off` leaves it unmanaged"),
                "{err}"
            );
            continue;
        }
        let plan = plan.unwrap_or_else(|e| panic!("{preset}: {e}"));
        println!("{preset} on {card_bytes} bytes:\n{plan}");
        for component in pipeline_zimage::pipeline::COMPONENTS {
            let why = plan.why(component).unwrap_or_default();
            assert!(!why.is_empty(), "{preset}: no reason for {component}");
        }
        let transformer = plan.applied("transformer").expect("applied");
        assert!(
            transformer.applied.is_group_offload(),
            "{preset}: the transformer does not fit whole, yet it was {}",
            transformer.applied
        );
        for applied in &plan.applied {
            assert_eq!(
                Some(applied.applied),
                applied.planned,
                "{preset}: {} ran another route than planned",
                applied.component
            );
        }
        if preset == Preset::DiffusersLeafOffloadCompat {
            assert!(matches!(transformer.applied, Route::LeafGroupOffload { .. }), "{plan}");
        }
        let run =
            generate_profiled(&pipeline, &plan, &opts, &mut |_, _| {}).unwrap_or_else(|e| panic!("{preset}: {e}"));
        let error = max_abs_diff(&values(run.image), &resident);
        assert!(error <= 1e-6, "{preset}: the image differs from the resident run's by {error}");
        assert!(card.peak() <= card_bytes, "{preset}: the hard card went past its capacity");
        assert_eq!(run.peak_device, card.peak());
        let stats = pipeline.group_stats("transformer").expect("grouped");
        assert!(stats.onloads + stats.prefetches > 0, "{preset}: no group moved: {stats:?}");
        for component in pipeline_zimage::pipeline::COMPONENTS {
            if let Some(stats) = pipeline.group_stats(component) {
                assert_eq!(stats.stray_loads, 0, "{preset}: {component} touched a weight it had not taken: {stats:?}");
            }
        }
    }
}

#[test]
fn auto_picks_resident_component_or_block_offload_by_the_card() {
    let (opts, _) = turbo_options();
    let resident = resident_image(&opts);
    let sizes = sizes(&opts);
    let roomy = sizes.text_encoder + sizes.transformer + sizes.vae + sizes.reserve + (1 << 20);
    let cards = [
        (roomy, [Route::Resident, Route::Resident, Route::Resident]),
        (sizes.component_card(), [Route::ComponentOffload, Route::ComponentOffload, Route::ComponentOffload]),
    ];
    for (card_bytes, routes) in cards {
        let scratch = Scratch::new("auto");
        let pairs = [("reserve", sizes.reserve.to_string()), ("profile_dir", scratch.0.display().to_string())];
        let (pipeline, card, plan) = plan_on(card_bytes, &pairs, &opts);
        let plan = plan.expect("plans");
        let applied: Vec<Route> = plan.applied.iter().map(|a| a.applied).collect();
        assert_eq!(applied, routes, "{plan}");
        let run = generate_profiled(&pipeline, &plan, &opts, &mut |_, _| {}).expect("runs");
        assert!(max_abs_diff(&values(run.image), &resident) <= 1e-6);
        assert!(card.peak() <= card_bytes);
        let record = pipeline.manager().offload_record();
        let offloads = record.events().iter().filter(|e| e.action == offload_core::Action::Offload).count();
        if routes[0] == Route::Resident {
            // Onloaded once, when the plan was applied, and never moved again.
            assert_eq!(offloads, 0, "{record}");
            assert_eq!(record.events().len(), 3, "{record}");
        } else {
            // Staged: each phase's component leaves when the next one comes.
            assert!(offloads >= 2, "{record}");
        }
    }
}

#[test]
fn generation_reports_three_phases_in_order() {
    let (opts, _) = turbo_options();
    let placement = OffloadDevice::host_only();
    let generated = load(placement).generate_with_report(&opts, &mut |_, _| {}).expect("runs");
    let names: Vec<&str> = generated.phases.phases.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, PHASES);
    assert!(generated.phases.phases.iter().all(|p| p.seconds >= 0.0 && p.release_seconds >= 0.0));
    assert_eq!(generated.phases.phases[2].release_seconds, 0.0, "nothing follows the last phase");
    let text = generated.phases.to_string();
    assert!(text.starts_with("encode") && text.contains("\ndenoise") && text.contains("\ntotal"), "{text}");
}

#[test]
fn a_run_is_recorded_in_its_capacity_profile_and_a_larger_one_is_warned_about() {
    let (small, _) = turbo_options();
    let mut large = small.clone();
    large.max_sequence_length = 64;
    let sizes = sizes(&large);
    let scratch = Scratch::new("profile");
    let pairs = [
        ("preset", "low_ram_safe".to_string()),
        ("reserve", sizes.reserve.to_string()),
        ("profile_dir", scratch.0.display().to_string()),
    ];
    let (pipeline, card, plan) = plan_on(sizes.streaming_card(), &pairs, &large);
    let plan = plan.expect("plans");

    let first = generate_profiled(&pipeline, &plan, &small, &mut |_, _| {}).expect("runs");
    assert!(first.record.path.starts_with(&scratch.0), "{}", first.record.path.display());
    assert!(first.record.path.is_file());
    // The profile was empty: every metric is unvalidated until this run.
    assert!(first.record.warnings.iter().all(|w| w.kind == WarningKind::Unvalidated), "{:?}", first.record.warnings);
    let stored =
        plan.profile_store().expect("store").load(&run_workload(&plan, &small)).expect("readable").expect("saved");
    assert_eq!(stored, first.record.profile);
    assert_eq!(stored.peaks.device, card.peak());
    assert_eq!(stored.limits.get("pixels").and_then(|l| l.max_success), Some(4096.0));
    assert_eq!(stored.limits.get("tokens").and_then(|l| l.max_success), Some(32.0));
    assert_eq!(stored.observations.len(), 1);
    assert_eq!(stored.observations[0].outcome, Outcome::Success);

    // Before the larger run, and in its result: 64 tokens is past the 32 that were validated.
    let before = check_capacity(&plan, &large).expect("checks");
    assert_eq!(before.len(), 1, "{before:?}");
    assert_eq!(before[0].metric, "tokens");
    assert_eq!(before[0].kind, WarningKind::BeyondValidated { max_success: 32.0 });
    assert!(
        before[0].to_string().starts_with("tokens = 64 exceeds the largest validated tokens (32)"),
        "{}",
        before[0]
    );
    let second = generate_profiled(&pipeline, &plan, &large, &mut |_, _| {}).expect("runs");
    assert_eq!(second.record.warnings, before);
    // The same size again is validated now.
    assert_eq!(check_capacity(&plan, &large).expect("checks"), []);
}

#[test]
fn named_calibration_measures_the_peak_then_later_runs_reuse_its_budget() {
    let (opts, _) = turbo_options();
    let resident = resident_image(&opts);
    let sizes = sizes(&opts);
    let scratch = Scratch::new("calibration");
    // A card large enough that the calibration's headroom (at least 256 MiB) leaves a budget to recommend;
    // low_ram_safe does not keep the whole pipeline resident, so the transformer streams.
    let card_bytes = 1u64 << 30;
    let pairs = [
        ("preset", "low_ram_safe".to_string()),
        ("reserve", sizes.reserve.to_string()),
        ("profile_dir", scratch.0.display().to_string()),
        ("profile_name", "tiny-64".to_string()),
    ];

    let (pipeline, card, plan) = plan_on(card_bytes, &pairs, &opts);
    let plan = plan.expect("plans");
    assert!(plan.calibration_run);
    let why = plan.why("transformer").unwrap_or_default();
    assert!(why.contains("calibration run of profile tiny-64"), "{why}");
    assert_eq!(plan.component("transformer").map(|c| c.resident_bytes), Some(sizes.outside));
    let first = generate_profiled(&pipeline, &plan, &opts, &mut |_, _| {}).expect("runs");
    assert!(max_abs_diff(&values(first.image), &resident) <= 1e-6);
    let recommendation = first.record.calibration.expect("a calibration run recommends");
    assert_eq!(recommendation.measured_peak, card.peak());
    assert_eq!(recommendation.resident_used, 0);
    assert!(recommendation.resident_budget > sizes.transformer, "{recommendation:?}");

    // A later run loads the recommendation: every block stays resident.
    let (pipeline, card, plan) = plan_on(card_bytes, &pairs, &opts);
    let plan = plan.expect("plans");
    assert!(!plan.calibration_run);
    assert_eq!(plan.settings.calibration, Some(recommendation));
    let why = plan.why("transformer").unwrap_or_default();
    assert!(why.contains("profile tiny-64 recommends"), "{why}");
    assert_eq!(plan.component("transformer").map(|c| c.resident_bytes), Some(sizes.transformer));
    let later = generate_profiled(&pipeline, &plan, &opts, &mut |_, _| {}).expect("runs");
    assert!(max_abs_diff(&values(later.image), &resident) <= 1e-6);
    assert_eq!(later.record.calibration, None);
    assert!(card.peak() > recommendation.measured_peak, "the resident blocks raise the peak");

    // calibrate = true measures again.
    let mut again = pairs.to_vec();
    again.push(("calibrate", "true".to_string()));
    let (_, _, plan) = plan_on(card_bytes, &again, &opts);
    assert!(plan.expect("plans").calibration_run);
}

#[test]
fn one_component_can_be_planned_alone() {
    let (opts, _) = turbo_options();
    let resident = resident_image(&opts);
    let sizes = sizes(&opts);
    let scratch = Scratch::new("one");
    let (mut pipeline, card) = on_card(sizes.streaming_card());
    let facts = card.device_facts(host());
    let pairs = [
        ("preset", "diffusers_offload_compat".to_string()),
        ("reserve", sizes.reserve.to_string()),
        ("profile_dir", scratch.0.display().to_string()),
    ];
    let plan =
        enable_offload(&mut pipeline, "transformer", settings(&pairs), &facts, &opts).expect("plans the transformer");
    assert_eq!(plan.plan.components.len(), 1);
    assert!(matches!(plan.applied("transformer").map(|a| a.applied), Some(Route::BlockGroupOffload { .. })));
    assert_eq!(plan.applied("vae").and_then(|a| a.planned), None);
    let image = pipeline.generate(&opts, &mut |_, _| {}).expect("runs");
    assert!(max_abs_diff(&values(image), &resident) <= 1e-6);
    assert!(card.peak() <= sizes.streaming_card());
}

#[test]
fn a_card_too_small_for_any_route_is_a_typed_planning_error() {
    let (opts, _) = turbo_options();
    let sizes = sizes(&opts);
    let (_, _, plan) = plan_on(sizes.reserve + sizes.outside, &[("reserve", sizes.reserve.to_string())], &opts);
    let err = plan.expect_err("nothing fits");
    assert!(matches!(err, pipeline_zimage::Error::Plan(_)), "{err:?}");
    assert!(err.to_string().starts_with("cannot plan transformer: leaf, prefetch needs"), "{err}");
    // Planning again after group offload was applied is refused rather than half-done.
    let (mut pipeline, card, plan) = plan_on(sizes.streaming_card(), &[("reserve", sizes.reserve.to_string())], &opts);
    plan.expect("plans");
    let facts = card.device_facts(host());
    let again = enable_pipeline_offload(&mut pipeline, Preset::Auto, &facts, &opts).expect_err("refused");
    assert!(
        matches!(again, pipeline_zimage::Error::GroupOffload(group_offload::Error::AlreadyApplied { .. })),
        "{again}"
    );
}

#[test]
fn a_plan_that_keeps_host_copies_on_disk_streams_them_from_files() {
    let (opts, _) = turbo_options();
    let resident = resident_image(&opts);
    let sizes = sizes(&opts);
    let scratch = Scratch::new("disk");
    let store = scratch.0.join("groups");
    let pairs = [
        ("preset", "low_ram_safe".to_string()),
        ("reserve", sizes.reserve.to_string()),
        ("profile_dir", scratch.0.join("profiles").display().to_string()),
        ("low_host_memory", "true".to_string()),
        ("disk_store_dir", store.display().to_string()),
    ];
    let (pipeline, _, plan) = plan_on(sizes.streaming_card(), &pairs, &opts);
    let plan = plan.expect("plans");
    assert!(plan.component("transformer").is_some_and(|c| c.on_disk), "{plan}");
    let how = &plan.applied("transformer").expect("applied").how;
    assert!(how.contains(&format!("host copies as files in {}", store.display())), "{how}");
    let files = std::fs::read_dir(&store).map(|dir| dir.count()).unwrap_or(0);
    assert!(files > 0, "no group was written to {}", store.display());
    let image = pipeline.generate(&opts, &mut |_, _| {}).expect("runs");
    assert!(max_abs_diff(&values(image), &resident) <= 1e-6);
}

#[test]
fn pinned_host_copies_are_staged_and_priced_as_pinned_copies_on_the_card() {
    let (opts, _) = turbo_options();
    let resident = resident_image(&opts);
    let sizes = sizes(&opts);
    let card_bytes = sizes.streaming_card();
    for (preset, pins) in [(Preset::WarmProcess, true), (Preset::NoPin, false)] {
        let scratch = Scratch::new("pinned");
        let spec = CardSpec::parse(&card_bytes.to_string())
            .expect("a size")
            .with_mode(Mode::Hard)
            .with_context_overhead(0)
            .with_pageable_fraction(0.5)
            .expect("a fraction");
        let card = SimCard::new(spec);
        let placement = OffloadDevice::simulated(card.clone());
        let mut pipeline = load(placement);
        let facts = card.device_facts(host());
        let pairs = [
            ("preset", preset.name().to_string()),
            ("reserve", sizes.reserve.to_string()),
            ("profile_dir", scratch.0.display().to_string()),
        ];
        let plan = enable_pipeline_offload(&mut pipeline, settings(&pairs), &facts, &opts).expect("plans");
        let planned = plan.component("transformer").expect("planned").pinned_bytes;
        let offload = pipeline.group_offload("transformer").expect("the transformer streams");
        let (pinned, page_locked) = offload.pinned_bytes();
        assert_eq!(page_locked, 0, "{preset}: the CPU backend has no page-locked memory");
        if pins {
            assert!(pinned > 0 && pinned <= planned, "{preset}: pinned {pinned} of the planned {planned}\n{plan}");
            assert!(plan.notes.iter().any(|n| n.contains("pinned through the device's staging")), "{plan}");
        } else {
            assert_eq!((planned, pinned), (0, 0), "{preset}: {plan}");
        }
        let image = pipeline.generate(&opts, &mut |_, _| {}).expect("runs");
        assert!(max_abs_diff(&values(image), &resident) <= 1e-6, "{preset}");
        let stats = card.stats();
        if pins {
            assert!(stats.bytes_pinned_to_device > 0, "{preset}: {stats:?}");
        } else {
            assert_eq!(stats.bytes_pinned_to_device, 0, "{preset}: {stats:?}");
        }
    }
}

/// Per image, what the record shows moving: `(onloads, bytes onloaded, offloads)`, and the ids onloaded.
fn moves_of(events: &[offload_core::OffloadEvent]) -> ((usize, u64, usize), Vec<String>) {
    let onloads: Vec<_> = events.iter().filter(|e| e.action == offload_core::Action::Onload).collect();
    let offloads = events.iter().filter(|e| e.action == offload_core::Action::Offload).count();
    let bytes = onloads.iter().map(|e| e.bytes).sum();
    ((onloads.len(), bytes, offloads), onloads.iter().map(|e| e.id.clone()).collect())
}

/// The second image is not slower for lack of planning: under every preset, on a card that must stream the
/// transformer, one that holds one component at a time and one that holds everything, images 2 to 4 move the
/// same groups and bytes as each other (each image after the first repeats the second), and nothing the plan
/// keeps resident is onloaded again after the first image.
#[test]
fn every_image_after_the_first_moves_the_same_and_reloads_nothing_the_plan_keeps_resident() {
    let (opts, _) = turbo_options();
    let sizes = sizes(&opts);
    let streaming = sizes.streaming_card();
    let mut resident_checked = 0;
    for card_bytes in [streaming, sizes.component_card(), 1 << 30] {
        for preset in Preset::ALL.into_iter().filter(|p| *p != Preset::Off) {
            let scratch = Scratch::new("images");
            let pairs = [
                ("preset", preset.name().to_string()),
                ("reserve", sizes.reserve.to_string()),
                ("profile_dir", scratch.0.display().to_string()),
                ("disk_store_dir", scratch.0.join("store").display().to_string()),
            ];
            let (pipeline, _card, plan) = plan_on(card_bytes, &pairs, &opts);
            let plan = plan.unwrap_or_else(|e| panic!("{preset:?} on {card_bytes} B: {e}"));
            let context = format!("{} on a {card_bytes} B card", preset.name());
            let mut seen = 0;
            let mut per_image = Vec::new();
            for _ in 0..4 {
                pipeline.generate(&opts, &mut |_, _| {}).unwrap_or_else(|e| panic!("{context}: {e}"));
                let events = pipeline.manager().offload_record().events();
                per_image.push(moves_of(&events[seen..]));
                seen = events.len();
            }
            if card_bytes == streaming {
                assert!(per_image[1].0.0 > 0, "{context}: the second image streamed nothing: {per_image:?}");
            }
            for (image, (moves, _)) in per_image.iter().enumerate().skip(2) {
                assert_eq!(*moves, per_image[1].0, "{context}: image {} moved other than image 2", image + 1);
            }
            for name in pipeline_zimage::pipeline::COMPONENTS {
                let resident = plan.plan.component(name).is_some_and(|c| c.route == Route::Resident);
                if !resident {
                    continue;
                }
                resident_checked += 1;
                for (image, (_, ids)) in per_image.iter().enumerate().skip(1) {
                    assert!(
                        !ids.iter().any(|id| id.starts_with(name)),
                        "{context}: {name} is resident in the plan but image {} onloaded it again: {ids:?}",
                        image + 1
                    );
                }
            }
        }
    }
    assert!(resident_checked > 0, "no plan kept a component resident: the check above held nothing");
}

/// A host with `usable` bytes the planner may fill (the 2 GiB margin on top).
fn small_host(usable: u64) -> HostMemory {
    HostMemory::new((2 << 30) + usable, (2 << 30) + usable)
}

/// Registered from its files on a card that must stream the transformer, with RAM for about half the
/// transformer: the copies do not fit whole, so they read their files, and the RAM left is placed over the
/// transformer's streamed groups (a split). The run keeps exactly the reads the plan placed in RAM, later images
/// read only the other streamed groups from the file, and the image is the resident run's.
#[test]
fn a_short_host_keeps_the_streamed_groups_the_plan_places_in_ram_and_reads_the_rest_from_the_file() {
    let (opts, _) = turbo_options();
    let resident = resident_image(&opts);
    let sizes = sizes(&opts);
    let spec = CardSpec::parse(&sizes.streaming_card().to_string())
        .expect("a size")
        .with_mode(Mode::Hard)
        .with_context_overhead(0);
    let card = SimCard::new(spec);
    let mut pipeline = ZImagePipeline::bind(
        common::fixtures().join("tiny-z-image-turbo"),
        OffloadDevice::simulated(card.clone()),
        &pipeline_zimage::loading::LoadOptions::new(),
        None,
        offload_core::Timeline::disabled(),
    )
    .expect("it binds");
    let scratch = Scratch::new("split");
    let pairs = [
        ("preset", "auto".to_string()),
        ("reserve", sizes.reserve.to_string()),
        ("profile_dir", scratch.0.display().to_string()),
    ];
    let facts = card.device_facts(small_host(sizes.transformer / 2));
    let plan = enable_pipeline_offload(&mut pipeline, settings(&pairs), &facts, &opts).expect("plans");
    let planned = plan.component("transformer").expect("planned").clone();
    assert!(matches!(planned.route, Route::BlockGroupOffload { .. }), "{plan}");
    assert!(planned.ram_streamed_bytes > 0 && planned.host_tier.reads_disk(), "no split:\n{plan}");
    assert!(plan.plan.host_bytes() <= plan.plan.usable_host, "{plan}");
    let how = &plan.applied("transformer").expect("applied").how;
    assert!(how.contains("kept in host memory after their first read"), "{how}");

    let offload = pipeline.group_offload("transformer").expect("the transformer streams").clone();
    for image in 0..2 {
        let reads = offload.disk_totals();
        let out = pipeline.generate(&opts, &mut |_, _| {}).expect("runs");
        assert!(max_abs_diff(&values(out), &resident) <= 1e-6, "image {image}");
        let (kept, _) = offload.kept_read_bytes();
        assert_eq!(kept, planned.ram_streamed_bytes, "image {image}: the run keeps what the plan placed in RAM");
        if image > 0 {
            // A later image reads the file for the streamed groups outside the RAM budget only.
            let streamed = planned.streamed_per_image - planned.ram_streamed_bytes * u64::from(planned.calls_per_image);
            let read = offload.disk_totals().bytes - reads.bytes;
            assert!(read > 0 && read <= streamed, "image {image}: read {read} of at most {streamed} from the file");
        }
    }
}
