//! Predicted beside measured: the planner's device peak, bytes moved and number of moves for one image, next to
//! what a run on the device (a simulated card, or a real cubecl device's pool) measured, and each component
//! call's activation high-water next to the estimate the planner and the reserve use.
//!
//! # What is measured, and how
//!
//! Each case generates two images and measures the second: a streamed component's first forward in the process
//! captures its call order without prefetch, and every later image repeats the second.
//!
//! - **Bytes moved and moves** are counted by [`Meter`], a [`DeviceLedger`] that wraps the device's own ledger
//!   and counts every host-to-device copy the mechanisms report (a component onloaded whole is one copy, each
//!   group upload one), over the second image (a `resident` component's onload is paid once per process).
//! - **The device peak** on a simulated card is the card's allocation read after every allocation and
//!   activation charge during each call ([`Meter::on_card`]; exact bytes: weights the mechanisms placed and each
//!   call's activation estimate); every byte is placed right before or during a call, so the run's peak is the
//!   highest call's. On a real device it is the high-water of the pool's pages above what the pool held before
//!   the pipeline's first onload ([`PoolReadings::reserved_peak`]), with the pool's cache released before every
//!   call ([`Meter::probing`]) and the pages read before each release and at the end of each call; under
//!   [`PagePolicy::Exclusive`](group_offload::device::PagePolicy) the pages follow the allocations, so they are what the
//!   device had to give. The sampled in-use high-water is a lower bound only and is not used.
//! - **Per phase**: each component's predicted peak beside the highest one of its calls reached.
//! - **A call's activations** ([`measure_calls`]): the pages the pool took during the call, from a released
//!   cache (the pipeline resident), so inputs the call makes, its intermediates and its output count, the
//!   weights do not.
//!
//! Predictions come from [`PipelinePlan`]: [`Plan::peak_bytes`](offload_core::plan::Plan::peak_bytes),
//! [`streamed_per_image`](offload_core::plan::Plan::streamed_per_image) and
//! [`moves_per_image`](offload_core::plan::Plan::moves_per_image).

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::tensor::Device;
use group_offload::{device::CappedDevice, device::PoolReadings};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::plan::{CallFootprint, Footprint, HostMemory, Preset, Route, Settings, SettingsLayer};
use offload_core::{ComponentError, DeviceLedger, DeviceMemory, Direction, format_size};

use crate::error::Result;
use crate::pipeline::{GenerateOptions, ZImagePipeline};
use crate::presets::{PipelinePlan, component_specs, enable_pipeline_offload, exact_reserve};
use group_offload::OffloadDevice;
use offload_core::plan::DeviceFacts;

/// What a [`Meter`] counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Moved {
    /// Bytes copied host to device (pinned or pageable).
    pub bytes: u64,
    /// Host-to-device copies.
    pub moves: u64,
}

/// One component call as a [`Meter`] in probing mode saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallReading {
    /// The activation estimate the call was run with (what a simulated card charges).
    pub estimate: u64,
    /// Pages the pool took during the call, from a released cache: an upper bound of the call's high-water.
    pub pages: u64,
    /// The sampled in-use high-water above the call's start: a lower bound.
    pub in_use: u64,
    /// The pool's pages when the call began, its cache released: what the call started from (weights, inputs).
    pub start: u64,
    /// The bytes in use when the call began.
    pub start_in_use: u64,
}

/// A [`DeviceLedger`] that passes everything to the device's own ledger and counts the host-to-device copies;
/// with [`Meter::probing`], it also measures each call's pages on a real device's pool.
pub struct Meter {
    inner: Arc<dyn DeviceLedger>,
    probe: Option<Arc<PoolReadings>>,
    card: Option<Arc<SimCard>>,
    state: Mutex<MeterState>,
}

#[derive(Default)]
struct MeterState {
    moved: Moved,
    starts: Vec<group_offload::device::PoolSnapshot>,
    calls: Vec<CallReading>,
    /// On a simulated card: the highest allocation seen since the open call began, and each call's.
    call_high: Option<u64>,
    call_peaks: Vec<u64>,
}

impl Meter {
    /// Counts the copies reported to `inner`.
    pub fn new(inner: Arc<dyn DeviceLedger>) -> Arc<Self> {
        Arc::new(Self { inner, probe: None, card: None, state: Mutex::new(MeterState::default()) })
    }

    /// Counts the copies a simulated card is told of, and keeps each call's peak allocation on it: the card's
    /// allocation read after every allocation, group upload and activation charge while the call is open (frees
    /// only lower it, so its highs come right after those).
    pub fn on_card(card: Arc<SimCard>) -> Arc<Self> {
        Arc::new(Self { inner: card.clone(), probe: None, card: Some(card), state: Mutex::new(MeterState::default()) })
    }

    /// On a simulated card ([`Meter::on_card`]), each call's peak allocation, in call order.
    pub fn call_peaks(&self) -> Vec<u64> {
        self.lock().call_peaks.clone()
    }

    fn note_card(&self) {
        if let Some(card) = &self.card {
            let allocated = card.allocated();
            let mut state = self.lock();
            if let Some(high) = &mut state.call_high {
                *high = (*high).max(allocated);
            }
        }
    }

    /// Counts copies, and before each call reads `pool` (so its page high-water counts what the pool took since
    /// the last call), releases the pool's cache and measures the pages the call takes ([`CallReading`]). The
    /// pool's high-water is then what the run held with the cache released before every call, as diffusers
    /// clears the device cache: the device memory the run needs, not what the allocator keeps for reuse.
    pub fn probing(inner: Arc<dyn DeviceLedger>, pool: Arc<PoolReadings>) -> Arc<Self> {
        Arc::new(Self { inner, probe: Some(pool), card: None, state: Mutex::new(MeterState::default()) })
    }

    /// What was copied to the device since the last [`reset`](Self::reset).
    pub fn moved(&self) -> Moved {
        self.lock().moved
    }

    /// The calls measured so far, in order.
    pub fn calls(&self) -> Vec<CallReading> {
        self.lock().calls.clone()
    }

    /// Starts counting again.
    pub fn reset(&self) {
        let mut state = self.lock();
        state.moved = Moved::default();
        state.calls.clear();
        state.call_peaks.clear();
    }

    fn lock(&self) -> MutexGuard<'_, MeterState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn count(&self, bytes: u64) {
        let mut state = self.lock();
        state.moved.bytes += bytes;
        state.moved.moves += 1;
    }
}

impl DeviceLedger for Meter {
    fn allocate(&self, bytes: u64) -> std::result::Result<(), ComponentError> {
        self.inner.allocate(bytes)?;
        self.note_card();
        Ok(())
    }

    fn free(&self, bytes: u64) {
        self.inner.free(bytes)
    }

    fn allocate_tensors(&self, sizes: &[u64]) -> std::result::Result<(), ComponentError> {
        self.inner.allocate_tensors(sizes)?;
        self.note_card();
        Ok(())
    }

    fn free_tensors(&self, sizes: &[u64]) {
        self.inner.free_tensors(sizes)
    }

    fn transfer(&self, bytes: u64, direction: Direction) -> std::result::Result<(), ComponentError> {
        self.inner.transfer(bytes, direction)?;
        if direction == Direction::HostToDevice {
            self.count(bytes);
        }
        Ok(())
    }

    fn transfer_pinned(&self, bytes: u64) -> std::result::Result<(), ComponentError> {
        self.inner.transfer_pinned(bytes)?;
        self.count(bytes);
        Ok(())
    }

    fn begin_call(&self, estimate: u64) -> std::result::Result<(), ComponentError> {
        if let Some(pool) = &self.probe {
            let unreadable = |unknown: group_offload::device::ReadingUnavailable| ComponentError::Device {
                device: unknown.device.clone(),
                message: format!("while metering a call: {unknown}"),
            };
            pool.observe().map_err(unreadable)?;
            pool.burn_device().memory_cleanup();
            let start = pool.begin_window().map_err(unreadable)?;
            self.lock().starts.push(start);
        }
        self.inner.begin_call(estimate)?;
        if let Some(card) = &self.card {
            let allocated = card.allocated();
            self.lock().call_high = Some(allocated);
        }
        Ok(())
    }

    fn end_call(&self, estimate: u64) -> std::result::Result<(), ComponentError> {
        if self.card.is_some() {
            self.note_card();
            let mut state = self.lock();
            if let Some(high) = state.call_high.take() {
                state.call_peaks.push(high);
            }
        }
        let closed = self.inner.end_call(estimate);
        if let Some(pool) = &self.probe {
            // A window whose last reading failed is left out of the calls read, never counted as zero pages.
            let window = pool.end_window().ok().flatten();
            let mut state = self.lock();
            if let (Some(start), Some(window)) = (state.starts.pop(), window) {
                state.calls.push(CallReading {
                    estimate,
                    pages: window.high_reserved.saturating_sub(start.reserved),
                    in_use: window.high_in_use.saturating_sub(start.in_use),
                    start: start.reserved,
                    start_in_use: start.in_use,
                });
            }
        }
        closed
    }
}

/// The three figures compared for one image.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Figures {
    /// Device peak, bytes.
    pub peak: u64,
    /// Bytes copied to the device.
    pub bytes: u64,
    /// Host-to-device copies.
    pub moves: u64,
}

/// One preset on one card: what the plan predicted and what the run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Validation {
    /// The preset.
    pub preset: Preset,
    /// The card's bytes (a simulated card's capacity, or the soft cap over the real device).
    pub card: u64,
    /// The routes planned, `text_encoder/transformer/vae`, short: `whole` is component offload, `block x1 d1`
    /// one block per group with prefetch depth 1, `leaf d1` leaf level with prefetch.
    pub routes: String,
    /// The planner's figures.
    pub predicted: Figures,
    /// The run's figures.
    pub measured: Figures,
    /// On a real device, each call's pages (from a released cache) and sampled in-use high-water, in call order;
    /// empty on a simulated card.
    pub calls: Vec<CallReading>,
    /// The plan's table (routes, resident, pinned, streamed, time and peak per component).
    pub plan: String,
    /// Per component: its predicted peak ([`ComponentPlan::peak_bytes`]) and the highest one of its calls
    /// reached: on a simulated card its peak allocation during the call; on a real device the call's starting
    /// pages and the pages it took, above the pool before the first onload.
    ///
    /// [`ComponentPlan::peak_bytes`]: offload_core::plan::ComponentPlan::peak_bytes
    pub phases: Vec<(String, u64, u64)>,
}

impl Validation {
    /// Predicted peak over measured peak.
    pub fn peak_ratio(&self) -> f64 {
        ratio(self.predicted.peak, self.measured.peak)
    }
}

fn ratio(predicted: u64, measured: u64) -> f64 {
    if measured == 0 { if predicted == 0 { 1.0 } else { f64::INFINITY } } else { predicted as f64 / measured as f64 }
}

/// The result of one case: measured, or why it was not run.
#[derive(Debug)]
pub enum Case {
    /// Planned and run.
    Measured(Validation),
    /// The planner or the pipeline refused it (a card too small, preset `off`): the error, in words.
    Refused {
        /// The preset.
        preset: Preset,
        /// The card's bytes.
        card: u64,
        /// Why.
        reason: String,
    },
}

/// Where a validation runs.
#[derive(Clone)]
pub enum Target {
    /// A hard simulated card of the case's size on the CPU, with no context overhead.
    Simulated,
    /// A real device (its pool read through [`PoolReadings`]), under a soft cap of the case's size; `total` is
    /// the device's capacity where the runtime reports none (wgpu).
    Device {
        /// The device object (its burn device opened with
        /// [`PagePolicy::Exclusive`](group_offload::device::PagePolicy) for page figures that follow the
        /// allocations): every case lays its cap over it ([`OffloadDevice::with_account`]), so every case uploads
        /// on its one upload thread, into one stream's pools.
        device: OffloadDevice,
        /// Its capacity where the runtime reports none.
        total: u64,
        /// The components' footprints measured on it ([`measure_footprints`]), which each case's plan counts
        /// their weights as; empty: their weight bytes.
        footprints: Vec<Footprint>,
        /// The pages their calls took on it ([`measure_footprints`]), which each case's plan counts a call as
        /// where they are above its estimate; empty: the estimates.
        calls: Vec<CallFootprint>,
    },
}

/// A fixed, plentiful host, so that plans do not depend on the machine.
pub fn validation_host() -> HostMemory {
    HostMemory::new(64 << 30, 60 << 30)
}

/// The settings of a case: the preset, and the exact reserve (the largest activation estimate), since on a card
/// of a few megabytes the planner's margin (at least 256 MiB) would leave no route.
fn settings(preset: Preset, reserve: u64) -> Result<Settings> {
    let explicit = SettingsLayer { preset: Some(preset), reserve: Some(reserve), ..SettingsLayer::default() };
    Ok(Settings::resolve(&explicit, std::iter::empty::<(String, String)>(), None)?)
}

/// [`validate`] for every preset but `off` on each of `cards`, card by card: the cases a validation table shows.
pub fn validate_presets(
    target: &Target,
    load: &dyn Fn(OffloadDevice) -> Result<ZImagePipeline>,
    cards: &[u64],
    opts: &GenerateOptions,
) -> Vec<Case> {
    let presets = || Preset::ALL.into_iter().filter(|p| *p != Preset::Off);
    cards.iter().flat_map(|card| presets().map(move |preset| validate(target, load, preset, *card, opts))).collect()
}

/// Plans `preset` for a card of `card` bytes on `target`, applies it to a pipeline `load` makes on that
/// placement, generates two images with `opts`, and returns the second one's figures side by side (the first image
/// captures each streamed component's call order, without prefetch; later images repeat the second).
pub fn validate(
    target: &Target,
    load: &dyn Fn(OffloadDevice) -> Result<ZImagePipeline>,
    preset: Preset,
    card: u64,
    opts: &GenerateOptions,
) -> Case {
    match run_case(target, load, preset, card, opts) {
        Ok(validation) => Case::Measured(validation),
        Err(error) => Case::Refused { preset, card, reason: error.to_string() },
    }
}

fn run_case(
    target: &Target,
    load: &dyn Fn(OffloadDevice) -> Result<ZImagePipeline>,
    preset: Preset,
    card: u64,
    opts: &GenerateOptions,
) -> Result<Validation> {
    match target {
        Target::Simulated => {
            let spec = CardSpec::parse(&card.to_string())
                .map_err(|e| crate::Error::InvalidArgument { name: "card", reason: e.to_string() })?
                .with_mode(Mode::Hard)
                .with_context_overhead(0);
            let sim = SimCard::new(spec);
            let meter = Meter::on_card(sim.clone());
            let placement = OffloadDevice::on_device(Device::flex(), sim.device(), meter.clone(), Some(sim.clone()));
            let mut pipeline = load(placement)?;
            let facts = sim.device_facts(validation_host());
            let settings = settings(preset, exact_reserve(&pipeline, opts))?;
            let plan = enable_pipeline_offload(&mut pipeline, settings, &facts, opts)?;
            // The first image captures each streamed component's call order (no prefetch); the second is the one
            // every later image repeats.
            pipeline.generate(opts, &mut |_, _| {})?;
            meter.reset();
            pipeline.generate(opts, &mut |_, _| {})?;
            let moved = meter.moved();
            // The card's peak over the second image: every byte is placed right before or during a call, so the
            // highest of the calls' peaks.
            let peak = meter.call_peaks().into_iter().max().unwrap_or(0);
            let mut validation =
                validation(preset, card, &plan, Figures { peak, bytes: moved.bytes, moves: moved.moves });
            validation.phases = phases(&plan, opts, &meter.call_peaks());
            Ok(validation)
        }
        Target::Device { device: on, total, footprints, calls } => {
            let (device, name) = (on.exec(), on.name());
            device.memory_cleanup();
            let readings = PoolReadings::open(device.clone(), name.clone(), Some(*total))?;
            let before = readings.observe().map_err(group_offload::Error::from)?.reserved;
            let cap = CappedDevice::new(readings.clone(), card, false, format_size(card));
            // The cap gives the readings the plan and the manager decide from; the meter releases the pool's cache
            // before each call and reads its pages (a soft cap's ledger would only keep a call window, which
            // the meter keeps).
            let meter = Meter::probing(Arc::new(offload_core::NoLedger), readings.clone());
            let mut pipeline = load(on.with_account(meter.clone(), Some(cap.clone())))?;
            let facts = DeviceFacts::new(cap.clone(), validation_host())
                .with_footprints(footprints.iter().cloned())
                .with_call_footprints(calls.iter().cloned());
            let settings = settings(preset, exact_reserve(&pipeline, opts))?;
            let plan = enable_pipeline_offload(&mut pipeline, settings, &facts, opts)?;
            pipeline.generate(opts, &mut |_, _| {})?;
            meter.reset();
            readings.reset_peak().map_err(group_offload::Error::from)?;
            pipeline.generate(opts, &mut |_, _| {})?;
            readings.observe().map_err(group_offload::Error::from)?;
            let moved = meter.moved();
            let peak = readings.reserved_peak().saturating_sub(before);
            drop(pipeline);
            device.memory_cleanup();
            let mut validation =
                validation(preset, card, &plan, Figures { peak, bytes: moved.bytes, moves: moved.moves });
            validation.calls = meter.calls();
            let peaks: Vec<u64> = validation.calls.iter().map(|c| (c.start + c.pages).saturating_sub(before)).collect();
            validation.phases = phases(&plan, opts, &peaks);
            Ok(validation)
        }
    }
}

/// Per component, its predicted peak beside the highest of its calls' measured peaks; calls come in pipeline
/// order: the text encoder once, the transformer once per step, the decode.
fn phases(plan: &PipelinePlan, opts: &GenerateOptions, call_peaks: &[u64]) -> Vec<(String, u64, u64)> {
    let owner = |i: usize| match i {
        0 => "text_encoder",
        i if i <= opts.steps => "transformer",
        _ => "vae",
    };
    ["text_encoder", "transformer", "vae"]
        .into_iter()
        .map(|component| {
            let measured = call_peaks
                .iter()
                .enumerate()
                .filter(|(i, _)| owner(*i) == component)
                .map(|(_, peak)| *peak)
                .max()
                .unwrap_or(0);
            let predicted = plan.component(component).map_or(0, |c| c.peak_bytes);
            (component.to_string(), predicted, measured)
        })
        .collect()
}

fn validation(preset: Preset, card: u64, plan: &PipelinePlan, measured: Figures) -> Validation {
    let routes = plan.plan.components.iter().map(|c| short_route(c.route)).collect::<Vec<_>>().join("/");
    let predicted = Figures {
        peak: plan.plan.peak_bytes(),
        bytes: plan.plan.streamed_per_image(),
        moves: plan.plan.moves_per_image(),
    };
    Validation {
        preset,
        card,
        routes,
        predicted,
        measured,
        calls: Vec::new(),
        plan: plan.plan.table(),
        phases: Vec::new(),
    }
}

fn short_route(route: Route) -> String {
    match route {
        Route::Resident => "resident".into(),
        Route::ComponentOffload => "whole".into(),
        Route::BlockGroupOffload { blocks_per_group, prefetch: true, depth } => {
            format!("block x{blocks_per_group} d{depth}")
        }
        Route::BlockGroupOffload { blocks_per_group, prefetch: false, .. } => format!("block x{blocks_per_group}"),
        Route::LeafGroupOffload { prefetch: true } => "leaf d1".into(),
        Route::LeafGroupOffload { prefetch: false } => "leaf".into(),
        Route::Off => "off".into(),
    }
}

/// The cards a validation runs the tiny pipeline on, from its sizes for the workload `opts`: one too small for
/// the transformer whole (it must stream: its outside bytes, three of its largest blocks and the activations),
/// one that holds any one component whole beside the activations but not all of them, and one that holds the
/// whole pipeline beside the largest activations.
pub fn validation_cards(pipeline: &ZImagePipeline, opts: &GenerateOptions) -> Result<[u64; 3]> {
    validation_cards_on(pipeline, opts, &[])
}

/// [`validation_cards`] on a device where the components' `footprints` were measured: the cards are sized from
/// what their weights take there (a runtime's pages), so each card still makes the pipeline stream, move whole or
/// stay.
pub fn validation_cards_on(
    pipeline: &ZImagePipeline,
    opts: &GenerateOptions,
    footprints: &[Footprint],
) -> Result<[u64; 3]> {
    let mut specs = component_specs(pipeline, opts)?;
    offload_core::plan::apply_footprints(&mut specs, footprints);
    let reserve = exact_reserve(pipeline, opts);
    let spec = |name: &str| specs.iter().find(|s| s.name == name);
    let device = |name: &str| spec(name).map_or(0, |s| s.device_weight());
    let (outside, largest) = spec("transformer").map_or((0, 0), |s| {
        s.layout.as_ref().map_or((0, 0), |l| {
            (s.on_device(l.outside_bytes), s.on_device(l.block_bytes.iter().copied().max().unwrap_or(0)))
        })
    });
    let all: u64 = specs.iter().map(|s| s.device_weight()).sum();
    let streaming = outside + 3 * largest + reserve;
    let component = device("transformer") + reserve + device("vae") / 2;
    let whole = all + reserve + (64 << 10);
    Ok([streaming, component, whole])
}

/// Measures each component call of one image on a real device with every component resident: the pages each
/// call takes from a released cache, beside its estimate, in call order (the text encoder, then the
/// transformer once per step, then the VAE's decode).
pub fn measure_calls(
    device: &OffloadDevice,
    total: u64,
    load: &dyn Fn(OffloadDevice) -> Result<ZImagePipeline>,
    opts: &GenerateOptions,
) -> Result<Vec<CallReading>> {
    run_resident(
        device,
        total,
        load,
        opts,
        1,
        |readings| Meter::probing(Arc::new(offload_core::NoLedger), readings),
        |_, meter| meter.calls(),
    )
}

/// `images` images of `opts` on a real device from a released cache, every component resident under the ledger
/// that `ledger` makes of the pool's readings, laid over `on` ([`OffloadDevice::with_account`]: its upload thread,
/// so the pages are those of the stream later runs on the device use); `read` takes its figures from the pipeline and the ledger before
/// the pipeline is dropped and the cache released again.
#[allow(clippy::too_many_arguments)]
fn run_resident<L: DeviceLedger + 'static, T>(
    on: &OffloadDevice,
    total: u64,
    load: &dyn Fn(OffloadDevice) -> Result<ZImagePipeline>,
    opts: &GenerateOptions,
    images: usize,
    ledger: impl FnOnce(Arc<PoolReadings>) -> Arc<L>,
    read: impl FnOnce(&ZImagePipeline, &L) -> T,
) -> Result<T> {
    let (device, name) = (on.exec(), on.name());
    device.memory_cleanup();
    let readings = PoolReadings::open(device.clone(), name.clone(), Some(total))?;
    let ledger = ledger(readings.clone());
    let pipeline = load(on.with_account(ledger.clone(), Some(readings)))?;
    pipeline.enable_auto_offload(0, true)?;
    for _ in 0..images {
        pipeline.generate(opts, &mut |_, _| {})?;
    }
    let figures = read(&pipeline, &ledger);
    drop(pipeline);
    device.memory_cleanup();
    Ok(figures)
}

/// What a resident run measured on a real device, in the pool's pages: each component's weights at its whole
/// onload ([`Footprint`]) and its second call ([`CallFootprint`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Footprints {
    /// The weights' footprints.
    pub weights: Vec<Footprint>,
    /// The calls' footprints.
    pub calls: Vec<CallFootprint>,
}

/// Measures each component's footprints on a real device ([`Footprints`]): two images of `opts` with every
/// component resident, each measuring its pages at its whole onload and at its second call (the first takes the
/// runtime's first buffers). What [`Target::Device`]'s plans then count the weights and the calls as.
pub fn measure_footprints(
    device: &OffloadDevice,
    total: u64,
    load: &dyn Fn(OffloadDevice) -> Result<ZImagePipeline>,
    opts: &GenerateOptions,
) -> Result<Footprints> {
    run_resident(
        device,
        total,
        load,
        opts,
        2,
        |_| Arc::new(offload_core::NoLedger),
        |pipeline, _| Footprints {
            weights: pipeline.manager().device_footprints(),
            calls: pipeline.manager().call_footprints(),
        },
    )
}

/// The table of [`Case`]s: per preset and card, predicted and measured peak, bytes and moves, and their ratios
/// (predicted over measured).
pub struct Table<'a>(pub &'a [Case]);

impl fmt::Display for Table<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let headers = [
            "preset",
            "card",
            "routes",
            "peak pred",
            "peak meas",
            "ratio",
            "bytes pred",
            "bytes meas",
            "ratio",
            "moves pred",
            "moves meas",
        ];
        let mut rows = Vec::new();
        for case in self.0 {
            rows.push(match case {
                Case::Measured(v) => vec![
                    v.preset.name().to_string(),
                    format_size(v.card),
                    v.routes.clone(),
                    v.predicted.peak.to_string(),
                    v.measured.peak.to_string(),
                    format!("{:.3}", v.peak_ratio()),
                    v.predicted.bytes.to_string(),
                    v.measured.bytes.to_string(),
                    format!("{:.3}", ratio(v.predicted.bytes, v.measured.bytes)),
                    v.predicted.moves.to_string(),
                    v.measured.moves.to_string(),
                ],
                Case::Refused { preset, card, reason } => {
                    let reason: String = reason.chars().take(90).collect();
                    vec![preset.name().to_string(), format_size(*card), format!("refused: {reason}")]
                }
            });
        }
        for line in offload_core::record::format_table(&headers, &rows) {
            writeln!(f, "{line}")?;
        }
        Ok(())
    }
}
