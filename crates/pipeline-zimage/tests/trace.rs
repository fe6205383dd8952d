//! A run you can look at: the tiny pipeline on a hard 8 MB simulated card under the `auto` preset (the
//! transformer streamed block by block with prefetch, the encoders moved whole by auto offload), recorded on a
//! timeline, written as a Chrome trace-event file, parsed back and checked against the manager's record and the
//! card's readings; and the memory plot of that run, decoded.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use group_offload::OffloadDevice;
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::plan::{HostMemory, Settings, SettingsLayer};
use offload_core::{Action, DeviceMemory, OffloadRecord, Reason, Timeline};
use pipeline_zimage::pipeline::{PHASES, ZImagePipeline};
use pipeline_zimage::plot::{ALLOCATED_COLOUR, PlotOptions, draw_memory_plot};
use pipeline_zimage::presets::enable_pipeline_offload;
use serde_json::Value;

mod common;

use common::{load_tiny, turbo_options};

/// The run: the tiny pipeline on a hard 8 MB card, planned by the `auto` preset with a 6 MB reserve (the
/// `docs/trace.md` run: the transformer cannot stay whole beside it, so it streams by blocks, and the encoders
/// move whole), recorded on a timeline with the memory sampler on.
fn traced_run() -> (ZImagePipeline, Arc<SimCard>, Timeline) {
    let (opts, _) = turbo_options();
    let spec = CardSpec::parse("8MB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0);
    let card = SimCard::new(spec);
    let mut pipeline = load_tiny(OffloadDevice::simulated(card.clone()));
    let timeline = Timeline::enabled();
    pipeline.set_timeline(timeline.clone()).expect("no group offload yet");
    let mut explicit = SettingsLayer::default();
    explicit.set("preset", "auto").expect("a preset");
    explicit.set("reserve", "6MB").expect("a size");
    let settings = Settings::resolve(&explicit, std::iter::empty::<(String, String)>(), None).expect("valid");
    let facts = card.device_facts(HostMemory::new(64 << 30, 60 << 30));
    let plan = enable_pipeline_offload(&mut pipeline, settings, &facts, &opts).expect("the preset applies");
    assert!(pipeline.is_grouped("transformer"), "the 8 MB card must stream the transformer\n{plan}");
    let sampler = timeline.sample_every(card.clone(), Duration::from_millis(1));
    pipeline.generate_with_report(&opts, &mut |_, _| {}).expect("the run succeeds");
    sampler.stop();
    (pipeline, card, timeline)
}

fn chrome_trace(timeline: &Timeline) -> Vec<Value> {
    let mut json = Vec::new();
    timeline.write_chrome_trace(&mut json).expect("written to memory");
    let trace: Value = serde_json::from_slice(&json).expect("the trace is JSON");
    assert_eq!(trace["displayTimeUnit"], "ms");
    trace["traceEvents"].as_array().expect("a traceEvents array").clone()
}

fn text<'a>(event: &'a Value, key: &str) -> &'a str {
    event[key].as_str().unwrap_or_else(|| panic!("{key} is not a string in {event}"))
}

/// The spans (`"X"`) of a category.
fn spans<'a>(events: &'a [Value], category: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    events.iter().filter(move |e| e["ph"] == "X" && e["cat"] == category)
}

/// How many record events of `action` carry one of `reasons` (`None` for a plain onload).
fn count(record: &OffloadRecord, action: Action, reasons: &[Option<&str>]) -> usize {
    record
        .events()
        .iter()
        .filter(|e| e.action == action && reasons.contains(&e.reason.as_ref().map(Reason::to_string).as_deref()))
        .count()
}

#[test]
fn the_trace_of_a_run_on_an_8mb_card_holds_its_phases_moves_threads_and_memory() {
    let (pipeline, card, timeline) = traced_run();
    let events = chrome_trace(&timeline);
    let record = pipeline.manager().offload_record();

    // Well-formed: every event has a phase type, a pid and a tid; every timed one a timestamp, a span a duration.
    for event in &events {
        let ph = text(event, "ph");
        assert!(["M", "X", "i", "C"].contains(&ph), "{event}");
        assert!(event["pid"].is_u64() && event["tid"].is_u64(), "{event}");
        assert!(event["name"].is_string(), "{event}");
        if ph != "M" {
            assert!(event["ts"].as_f64().is_some_and(|ts| ts >= 0.0), "{event}");
            assert!(event["cat"].is_string(), "{event}");
        }
        if ph == "X" {
            assert!(event["dur"].as_f64().is_some_and(|dur| dur >= 0.0), "{event}");
        }
    }
    let thread_names: HashMap<u64, &str> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| (e["tid"].as_u64().unwrap_or(0), e["args"]["name"].as_str().unwrap_or("")))
        .collect();
    for event in events.iter().filter(|e| e["ph"] != "M") {
        let tid = event["tid"].as_u64().unwrap_or(0);
        assert!(thread_names.contains_key(&tid), "thread {tid} has no thread_name: {event}");
    }

    // The phases, in order, on one thread (the caller's), and the four denoising steps.
    let phases: Vec<&Value> = spans(&events, "phase").filter(|e| !text(e, "name").starts_with("release")).collect();
    let names: Vec<&str> = phases.iter().map(|e| text(e, "name")).collect();
    assert_eq!(names, PHASES);
    let caller = phases[0]["tid"].as_u64().expect("a tid");
    assert!(phases.iter().all(|p| p["tid"].as_u64() == Some(caller)));
    assert_eq!(spans(&events, "step").count(), 4);

    // The link rate track: one sample at the end of each timed group upload, a positive rate.
    let uploads = spans(&events, "upload").filter(|e| e["dur"].as_f64().is_some_and(|d| d > 0.0)).count();
    let link: Vec<&Value> = events.iter().filter(|e| e["ph"] == "C" && e["name"] == "link rate").collect();
    assert!(uploads > 0 && link.len() == uploads, "{} link samples for {uploads} uploads", link.len());
    assert!(link.iter().all(|e| e["args"]["MB/s"].as_u64().is_some_and(|r| r > 0)), "{:?}", link.first());

    // Every component's onload, and as many whole-component onloads and offloads as the record holds.
    let onloaded: HashSet<&str> = spans(&events, "onload").map(|e| text(e, "name")).collect();
    for id in pipeline.components().map(|c| c.id()) {
        assert!(onloaded.contains(id), "no onload of {id} in the trace: {onloaded:?}");
    }
    assert_eq!(spans(&events, "onload").count(), count(&record, Action::Onload, &[None]));
    let offloads = spans(&events, "offload").count();
    assert!(offloads >= 2, "the staged strategy evicts the text encoder, then the transformer");
    assert_eq!(
        offloads,
        record.events().iter().filter(|e| e.action == Action::Offload && e.reason != Some(group_reason())).count()
    );
    for span in spans(&events, "onload").chain(spans(&events, "offload")) {
        assert!(span["args"]["bytes"].as_u64().is_some_and(|b| b > 0), "{span}");
    }

    // Each group upload is a span, as many as the record's group onloads; prefetches run on the worker thread.
    let uploads: Vec<&Value> = spans(&events, "upload").collect();
    assert_eq!(uploads.len(), count(&record, Action::Onload, &[Some("group_onload"), Some("prefetch")]));
    let prefetches: Vec<&Value> = uploads.iter().copied().filter(|e| e["args"]["reason"] == "prefetch").collect();
    assert!(!prefetches.is_empty(), "block level with prefetch uploads on the worker");
    let computes: Vec<&Value> = spans(&events, "compute").collect();
    assert!(!computes.is_empty());
    let compute_thread = computes[0]["tid"].as_u64().expect("a tid");
    assert_eq!(compute_thread, caller, "groups compute on the caller's thread");
    for prefetch in &prefetches {
        let tid = prefetch["tid"].as_u64().expect("a tid");
        assert_ne!(tid, compute_thread, "a prefetch ran on the compute thread: {prefetch}");
        assert_eq!(thread_names[&tid], "group-offload-transformer");
    }
    assert_eq!(spans(&events, "release").count(), count(&record, Action::Offload, &[Some("group_offload")]));

    // The memory counter: samples from the card's own readings, never above its peak, adding up to its size.
    let counters: Vec<&Value> = events.iter().filter(|e| e["ph"] == "C" && e["name"] == "device memory").collect();
    assert!(counters.len() > uploads.len(), "a sample after every move at least");
    let allocated: Vec<u64> = counters.iter().map(|e| e["args"]["allocated"].as_u64().expect("bytes")).collect();
    let max = allocated.iter().copied().max().unwrap_or(0);
    assert!(max > 0 && max <= card.peak(), "max sample {max}, card peak {}", card.peak());
    for counter in &counters {
        let sum =
            counter["args"]["allocated"].as_u64().unwrap_or(0) + counter["args"]["available"].as_u64().unwrap_or(0);
        assert!(sum <= card.total(), "{counter}");
    }
    assert_eq!(allocated.first(), Some(&0), "the card starts empty");
}

fn group_reason() -> Reason {
    Reason::GroupOffload
}

#[test]
fn the_memory_plot_of_the_run_is_a_png_of_the_asked_size_with_the_memory_line_drawn() {
    let (_, card, timeline) = traced_run();
    let dir = std::env::temp_dir().join(format!("pipeline-zimage-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let path = dir.join("memory.png");
    let options = PlotOptions { width: 900, height: 420, capacity: Some(card.total()), ..PlotOptions::default() };
    let summary = draw_memory_plot(&timeline, &path, &options).expect("drawn");
    assert!(summary.samples > 0 && summary.marks > 0, "{summary:?}");
    assert!(summary.link_samples > 0, "the streamed transformer's uploads are in the link panel: {summary:?}");
    let image = image::open(&path).expect("the PNG decodes").to_rgb8();
    assert_eq!(image.dimensions(), (900, 420));
    let line = image::Rgb([ALLOCATED_COLOUR.0, ALLOCATED_COLOUR.1, ALLOCATED_COLOUR.2]);
    let drawn = image.pixels().filter(|p| **p == line).count();
    assert!(drawn > 500, "only {drawn} pixels of the memory line");

    // A timeline without memory samples has nothing to plot, and says why.
    let empty = Timeline::enabled();
    let error = draw_memory_plot(&empty, &dir.join("empty.png"), &options).expect_err("nothing to draw");
    assert!(error.to_string().contains("no device memory sample"), "{error}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_timeline_set_after_group_offload_is_refused() {
    let spec = CardSpec::parse("8MB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0);
    let card = SimCard::new(spec);
    let mut pipeline = load_tiny(OffloadDevice::simulated(card.clone()));
    pipeline.enable_group_offload(1, 1).expect("group offload");
    let error = pipeline.set_timeline(Timeline::enabled()).expect_err("refused");
    assert!(error.to_string().contains("set the timeline before enabling group offload"), "{error}");
    assert!(!pipeline.timeline().is_enabled());
}

/// Two cards in one run (the text encoder on `cuda:1`): each card's memory is a track of its own in the trace
/// (`device memory` for the execution device, `device memory cuda:1` for the other), never one track mixing both,
/// and the memory plot draws a line for each.
#[test]
fn each_card_of_a_device_map_has_its_own_memory_track_and_line() {
    use pipeline_zimage::loading::LoadOptions;
    use pipeline_zimage::pipeline::DeviceMap;
    use pipeline_zimage::plot::OTHER_DEVICE_COLOURS;
    let (opts, _) = turbo_options();
    let first = SimCard::new(CardSpec::parse("64MiB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0));
    let mut spec = CardSpec::parse("64MiB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0);
    spec.device = offload_core::DeviceName::parse("cuda:1").expect("a name");
    let second = SimCard::new(spec);
    let (gpu0, gpu1) = (OffloadDevice::simulated(first.clone()), OffloadDevice::simulated(second.clone()));
    let map = DeviceMap::single(gpu0.clone()).with("text_encoder", gpu1.clone()).expect("a component");
    let dir = common::fixtures().join("tiny-z-image-turbo");
    let mut pipeline = ZImagePipeline::load_mapped(dir, map, &LoadOptions::new()).expect("loads over two cards");
    let timeline = Timeline::enabled();
    pipeline.set_timeline(timeline.clone()).expect("no group offload yet");
    gpu0.enable_auto_offload(0).expect("auto offload");
    gpu1.enable_auto_offload(0).expect("auto offload");
    pipeline.generate(&opts, &mut |_, _| {}).expect("the run succeeds");

    let tracks = timeline.memory_tracks();
    let names: Vec<&str> = tracks.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["device memory", "device memory cuda:1"]);
    // The second card's track holds only its own readings: at most what it held, and it held the text encoder.
    let second_max = tracks[1].1.iter().map(|s| s.allocated).max().expect("samples of cuda:1");
    assert!(second_max > 0 && second_max <= second.peak(), "{second_max} against a peak of {}", second.peak());
    assert!(tracks[0].1.iter().all(|s| s.allocated <= first.peak()));
    let events = chrome_trace(&timeline);
    let counters: HashSet<&str> = events.iter().filter(|e| e["ph"] == "C").map(|e| text(e, "name")).collect();
    assert_eq!(counters, HashSet::from(["device memory", "device memory cuda:1"]));

    let out = std::env::temp_dir().join(format!("pipeline-zimage-two-cards-{}", std::process::id()));
    std::fs::create_dir_all(&out).expect("a temporary directory");
    let path = out.join("memory.png");
    let summary = draw_memory_plot(&timeline, &path, &PlotOptions::default()).expect("drawn");
    assert_eq!(summary.devices, 2, "{summary:?}");
    let image = image::open(&path).expect("the PNG decodes").to_rgb8();
    let colour = OTHER_DEVICE_COLOURS[0];
    let drawn = image.pixels().filter(|p| **p == image::Rgb([colour.0, colour.1, colour.2])).count();
    assert!(drawn > 100, "only {drawn} pixels of the second card's line");
    std::fs::remove_dir_all(&out).ok();
}

/// A donor card holding the transformer's streamed groups has a memory track of its own in the trace and a line in
/// the plot, its samples what the card held.
#[test]
fn a_donor_card_has_its_own_memory_track_and_line() {
    use group_offload::config::PeerDonor;
    use pipeline_zimage::loading::LoadOptions;
    use pipeline_zimage::pipeline::DeviceMap;
    let (opts, _) = turbo_options();
    let first = SimCard::new(CardSpec::parse("8MB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0));
    let mut spec = CardSpec::parse("8MB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0);
    spec.device = offload_core::DeviceName::parse("cuda:1").expect("a name");
    let second = SimCard::new(spec);
    let gpu0 = OffloadDevice::simulated(first);
    let dir = common::fixtures().join("tiny-z-image-turbo");
    let mut pipeline =
        ZImagePipeline::load_mapped(dir, DeviceMap::single(gpu0), &LoadOptions::new()).expect("loads on one card");
    let timeline = Timeline::enabled();
    pipeline.set_timeline(timeline.clone()).expect("no group offload yet");
    let donor = PeerDonor::new(OffloadDevice::simulated(second.clone()), second.total(), 50e9);
    pipeline.transformer_mut().add_donor(donor).expect("before group offload");
    pipeline.enable_group_offload(1, 1).expect("group offload");
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    pipeline.generate(&opts, &mut |_, _| {}).expect("the run succeeds");

    let tracks = timeline.memory_tracks();
    let names: Vec<&str> = tracks.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, ["device memory", "device memory cuda:1"]);
    let donor_max = tracks[1].1.iter().map(|s| s.allocated).max().expect("samples of cuda:1");
    assert!(donor_max > 0 && donor_max == second.peak(), "{donor_max} against a peak of {}", second.peak());
    let out = std::env::temp_dir().join(format!("pipeline-zimage-donor-plot-{}", std::process::id()));
    std::fs::create_dir_all(&out).expect("a temporary directory");
    let summary = draw_memory_plot(&timeline, &out.join("memory.png"), &PlotOptions::default()).expect("drawn");
    assert_eq!(summary.devices, 2, "{summary:?}");
    std::fs::remove_dir_all(&out).ok();
}
