//! The planner: routes every component by preset, sizes its resident and pinned bytes, predicts its time and
//! peak with the [`TimeModel`], and says why.
//!
//! # The model
//!
//! Phases are staged: a component runs with the others offloaded (the [`Phases`](crate::plan::Phases) release
//! hook gives back what the previous phase held), so each component is planned against the whole device, less
//! the components routed [`Route::Resident`]. A component keeps `headroom` free for activations: the `reserve`
//! setting when given, else its activation estimate plus [`activation_margin`]. Per call it holds its resident
//! bytes plus a streaming window on the device. The first call of an image streams every byte (that is when
//! resident groups arrive); later calls stream what is not resident. Prefetched copies overlap compute, so a
//! call takes the longer of the two; without prefetch, the sum. Per-step figures are per-image figures divided
//! by the component's calls per image.

use std::fmt;

use crate::plan::budget::{
    activation_headroom, activation_margin, full_pin_zero_resident, pinned_budget, resident_budget, streaming_window,
    usable_host, weight_room,
};
use crate::plan::component::{ComponentSpec, HostTier, Route};
use crate::plan::error::PlanError;
use crate::plan::link::LinkSource;
use crate::plan::machine::{Machine, PeerShare, TimeModel};
use crate::plan::preset::{PinPolicy, Preset, PresetDefaults, ResidentPolicy, Routing};
use crate::plan::settings::{HostTierSetting, Settings};
use crate::size::format_size;

mod streams;

/// One component's plan: its route, where its bytes are, what it streams, and what it is predicted to cost.
#[derive(Debug, Clone, PartialEq)]
pub struct ComponentPlan {
    /// The component's name.
    pub component: String,
    /// Where its weights go.
    pub route: Route,
    /// Device bytes held through its phase without streaming (the whole component when resident or
    /// component-offloaded; the outside bytes and resident groups under block offload).
    pub resident_bytes: u64,
    /// The weight bytes of what stays on the device (`resident_bytes` counts them in the device's pages where
    /// the component's footprint was measured, [`ComponentSpec::device_bytes`]): the unit group offload's resident
    /// budget keeps groups in.
    pub resident_weight_bytes: u64,
    /// Host bytes pinned for it.
    pub pinned_bytes: u64,
    /// Each pinned group's bytes, in call order, where the plan placed its streamed groups over peers and pinned
    /// memory and the layout gives every group's size: a run then pins exactly groups of these sizes
    /// (`GroupOptions::pinned_groups`). Empty otherwise: the run pins the first streamed groups that fit
    /// `pinned_bytes`.
    pub pinned_groups: Vec<u64>,
    /// Host bytes its host copy takes in RAM (0 when resident or kept on disk; under a split, the streamed groups
    /// kept in RAM, `ram_streamed_bytes`).
    pub host_bytes: u64,
    /// Bytes of its streamed groups whose host copy is kept in RAM although its tier is the checkpoint file or
    /// the disk store: a split of the groups over RAM and the file, placed by cost
    /// ([`DonorProblem`](crate::plan::DonorProblem)) where the copies do not fit whole. Group offload keeps each
    /// streamed group it reads from a file in RAM while they fit in this budget
    /// (`GroupOptions::ram_budget`). 0 without a split.
    pub ram_streamed_bytes: u64,
    /// Each of those groups' bytes, in call order, where the component's layout gives every group's size: a run
    /// then keeps the reads of exactly groups of these sizes (`GroupOptions::ram_groups`), as the search placed
    /// them. Empty without a split, or where the sizes are estimates (leaves counted, not measured).
    pub ram_streamed_groups: Vec<u64>,
    /// What its streamed groups hold on each of the machine's peers ([`Machine::peers`]), one share per peer in
    /// the machine's order (empty without peers): placed by cost over the peers and the host's sources. A run's
    /// donor holds at most its share (`GroupOptions::donor_budgets`), and where the sizes are known exactly its
    /// groups (`GroupOptions::donor_groups`).
    pub peers: Vec<PeerShare>,
    /// Whether its streamed host copy is kept as files in `disk_store_dir` (`host_tier` is
    /// [`HostTier::DiskStore`]).
    pub on_disk: bool,
    /// Where its host copy lives: RAM, the checkpoint file or the disk store; for a resident component, where it
    /// is loaded from (from the file it keeps no host copy).
    pub host_tier: HostTier,
    /// The bytes of its host copy in its tier: `host_bytes` in RAM, the weights its uploads read from the
    /// checkpoint file or the disk store, 0 for a resident component loaded from its file.
    pub host_copy_bytes: u64,
    /// Device bytes kept free for its activations.
    pub headroom_bytes: u64,
    /// Bytes its calls stream to the device per step: per image, divided by its calls per image, without the
    /// last call's prefetch for a next call (see `streamed_per_image`).
    pub streamed_per_step: u64,
    /// Bytes it streams to the device per image: its calls' streaming, and with prefetch, what the last call
    /// prefetches for a next forward that the phase does not make (the prefetch window wraps into the next
    /// forward; those groups are released with the phase). Per image in a warm process: the process's first
    /// forward of a component captures its call order without prefetch.
    pub streamed_per_image: u64,
    /// Host-to-device copies per image: one per streamed group (the bytes outside the blocks count as one group
    /// when they stream), the last call's wrapped prefetch included, and one for a component that moves whole;
    /// 0 when resident. With
    /// [`streamed_per_image`](Self::streamed_per_image), what a run's ledger sees cross the link.
    pub moves_per_image: u64,
    /// Predicted seconds per step (per image, divided by its calls per image).
    pub seconds_per_step: f64,
    /// Predicted seconds per image.
    pub seconds_per_image: f64,
    /// Predicted device peak while it runs: its weights on the device, its activations and the resident
    /// components of the rest of the pipeline.
    pub peak_bytes: u64,
    /// Calls per image.
    pub calls_per_image: u32,
    /// Why: the route and budgets, from the numbers.
    pub why: String,
}

/// A whole pipeline's plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The preset that was resolved.
    pub preset: Preset,
    /// The machine it was made for (host `available` as overridden by the settings).
    pub machine: Machine,
    /// One plan per component, in the order given.
    pub components: Vec<ComponentPlan>,
    /// Host RAM the plan may fill: available less the host margin.
    pub usable_host: u64,
    /// Problems the plan predicts, each with what to do.
    pub warnings: Vec<String>,
}

impl ComponentPlan {
    /// Bytes of its streamed groups the plan holds on the peer named `peer` (0 for a peer it does not use).
    pub fn peer_bytes(&self, peer: &str) -> u64 {
        self.peers.iter().filter(|share| share.peer == peer).map(|share| share.bytes).sum()
    }

    /// Where its host copies are, as the table shows it: the tier, `+ram` for a split, `+cuda:1` for each peer
    /// holding some of its groups.
    fn host_column(&self) -> String {
        let mut host = self.host_tier.to_string();
        if self.ram_streamed_bytes > 0 {
            host.push_str("+ram");
        }
        for share in self.peers.iter().filter(|share| share.bytes > 0) {
            host.push('+');
            host.push_str(&share.peer);
        }
        host
    }
}

impl Plan {
    /// A component's plan by name.
    pub fn component(&self, name: &str) -> Option<&ComponentPlan> {
        self.components.iter().find(|c| c.component == name)
    }

    /// The predicted device peak of the whole run.
    pub fn peak_bytes(&self) -> u64 {
        self.components.iter().map(|c| c.peak_bytes).max().unwrap_or(0)
    }

    /// Predicted seconds per image.
    pub fn seconds_per_image(&self) -> f64 {
        self.components.iter().map(|c| c.seconds_per_image).sum()
    }

    /// Host RAM bytes of all host copies (the [`HostTier::Ram`] tier).
    pub fn host_bytes(&self) -> u64 {
        self.components.iter().map(|c| c.host_bytes).sum()
    }

    /// The bytes of the host copies in `tier` ([`ComponentPlan::host_copy_bytes`]): RAM, the checkpoint files the
    /// uploads read, or the disk store.
    pub fn host_bytes_in(&self, tier: HostTier) -> u64 {
        self.components.iter().filter(|c| c.host_tier == tier).map(|c| c.host_copy_bytes).sum()
    }

    /// Whether any upload reads the disk (a copy in the checkpoint file or the disk store that moves).
    pub fn reads_disk(&self) -> bool {
        self.components.iter().any(|c| c.host_tier.reads_disk() && c.host_copy_bytes > 0)
    }

    /// Host bytes pinned.
    pub fn pinned_bytes(&self) -> u64 {
        self.components.iter().map(|c| c.pinned_bytes).sum()
    }

    /// Predicted bytes copied to the device per image, over every component.
    pub fn streamed_per_image(&self) -> u64 {
        self.components.iter().map(|c| c.streamed_per_image).sum()
    }

    /// Predicted host-to-device copies per image, over every component.
    pub fn moves_per_image(&self) -> u64 {
        self.components.iter().map(|c| c.moves_per_image).sum()
    }

    /// The table alone, without the header, reasons or warnings.
    pub fn table(&self) -> String {
        let headers = ["component", "route", "host", "resident", "pinned", "streamed/step", "time/step", "peak"];
        let rows: Vec<[String; 8]> = self
            .components
            .iter()
            .map(|c| {
                [
                    c.component.clone(),
                    c.route.to_string(),
                    c.host_column(),
                    format_size(c.resident_bytes),
                    format_size(c.pinned_bytes),
                    format_size(c.streamed_per_step),
                    format!("{:.3} s", c.seconds_per_step),
                    format_size(c.peak_bytes),
                ]
            })
            .collect();
        let mut widths = headers.map(str::len);
        for row in &rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.len());
            }
        }
        let line = |cells: [&str; 8]| {
            let mut out = String::new();
            for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
                match i {
                    0..=2 => out.push_str(&format!("{cell:<width$}  ")),
                    _ => out.push_str(&format!("{cell:>width$}  ")),
                }
            }
            out.trim_end().to_string()
        };
        let mut out = line(headers);
        out.push('\n');
        for row in &rows {
            out.push_str(&line(row.each_ref().map(String::as_str)));
            out.push('\n');
        }
        out
    }
}

impl fmt::Display for Plan {
    /// A header with the machine, the table, the per-image totals, one reason per component and the warnings.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.machine;
        writeln!(
            f,
            "plan for preset {}: device {} available of {}; host {} available of {} ({} usable)",
            self.preset,
            format_size(m.device_available),
            format_size(m.device_total),
            format_size(m.host.available),
            format_size(m.host.total),
            format_size(self.usable_host)
        )?;
        writeln!(
            f,
            "link: {} from pinned memory, {} pageable ({})",
            crate::format_rate(m.time.link_bytes_per_second),
            crate::format_rate(m.time.link_bytes_per_second * m.time.pageable_fraction.clamp(0.01, 1.0)),
            m.time.link_source
        )?;
        if self.reads_disk() {
            writeln!(
                f,
                "disk: {} read ({})",
                crate::format_rate(m.time.disk_bytes_per_second),
                disk_source(m.time.disk_source)
            )?;
        }
        write!(f, "{}", self.table())?;
        let steps = self.components.iter().map(|c| c.calls_per_image).max().unwrap_or(1);
        let mut off_ram = String::new();
        for (tier, place) in [(HostTier::File, "in checkpoint files"), (HostTier::DiskStore, "in the disk store")] {
            let bytes = self.host_bytes_in(tier);
            if bytes > 0 {
                off_ram.push_str(&format!(", {} {place}", format_size(bytes)));
            }
        }
        writeln!(
            f,
            "per image ({steps} steps): {:.2} s predicted, peak {} of {} available; host copies: {} in RAM of {} usable, \
             {} pinned{off_ram}",
            self.seconds_per_image(),
            format_size(self.peak_bytes()),
            format_size(m.device_available),
            format_size(self.host_bytes()),
            format_size(self.usable_host),
            format_size(self.pinned_bytes())
        )?;
        writeln!(f, "why:")?;
        for c in &self.components {
            writeln!(f, "  {}: {}", c.component, c.why)?;
        }
        if !self.warnings.is_empty() {
            writeln!(f, "warnings:")?;
            for w in &self.warnings {
                writeln!(f, "  {w}")?;
            }
        }
        Ok(())
    }
}

/// Plans one component on its own: the pipeline's planner with a single component (the pipeline crate wraps
/// [`plan_pipeline`] for whole pipelines).
///
/// `settings` is a [`Settings`] or just a [`Preset`].
pub fn enable_offload(
    component: &ComponentSpec,
    settings: impl Into<Settings>,
    machine: &Machine,
) -> Result<ComponentPlan, PlanError> {
    let plan = plan_pipeline(std::slice::from_ref(component), settings, machine)?;
    plan.components.into_iter().next().ok_or_else(|| PlanError::InvalidComponent {
        component: component.name.clone(),
        problem: "the planner returned no plan for it; report this as a bug".into(),
    })
}

/// Plans every component of a pipeline: routes by the preset, budgets from the machine, predictions from its
/// time model, and one reason per component.
///
/// ```
/// use offload_core::plan::{BlockLayout, ComponentSpec, HostMemory, Machine, Preset, Route, plan_pipeline};
/// let gib = 1u64 << 30;
/// let denoiser = ComponentSpec::new("denoiser", 12 * gib)
///     .with_layout(BlockLayout { block_bytes: vec![gib; 12], outside_bytes: 0, largest_leaf_bytes: gib / 8, leaf_count: 96, first_leaf_bytes: gib / 8, leaf_bytes: Vec::new() })
///     .with_activation(gib)
///     .with_cost(4e13, 8);
/// let machine = Machine::new(8 * gib, 7 * gib, HostMemory::new(64 * gib, 60 * gib));
/// let plan = plan_pipeline(&[denoiser], Preset::Auto, &machine)?;
/// let denoiser = &plan.components[0];
/// assert!(matches!(denoiser.route, Route::BlockGroupOffload { blocks_per_group: 1, prefetch: true, depth: 1 }));
/// assert!(denoiser.peak_bytes <= machine.device_available);
/// println!("{plan}");
/// # Ok::<(), offload_core::plan::PlanError>(())
/// ```
pub fn plan_pipeline(
    components: &[ComponentSpec],
    settings: impl Into<Settings>,
    machine: &Machine,
) -> Result<Plan, PlanError> {
    let settings = settings.into();
    machine.time.validate()?;
    for (i, spec) in components.iter().enumerate() {
        spec.validate()?;
        if components[..i].iter().any(|other| other.name == spec.name) {
            return Err(PlanError::InvalidComponent {
                component: spec.name.clone(),
                problem: "two components have this name; give each a distinct name".into(),
            });
        }
    }
    let machine = match settings.host_available {
        Some(available) => machine.clone().with_host_available(available),
        None => machine.clone(),
    };
    for peer in &machine.peers {
        peer.validate()?;
    }
    let planner = Planner {
        settings: &settings,
        defaults: settings.preset.defaults(),
        usable_host: usable_host(machine.host),
        machine,
    };
    planner.plan(components)
}

struct Planner<'a> {
    settings: &'a Settings,
    defaults: PresetDefaults,
    machine: Machine,
    usable_host: u64,
}

/// Why a block-offloaded component keeps the resident bytes it keeps.
#[derive(Debug, Clone, PartialEq)]
enum ResidentReason {
    Fill,
    CalledOnce,
    PresetZero,
    FullPin { ratio: f64 },
    Setting,
    CalibrationRun(String),
    Calibrated { name: String, budget: u64, peak: u64 },
}

/// A route with its byte decisions.
#[derive(Debug, Clone, PartialEq)]
struct Shape {
    route: Route,
    resident_budget: u64,
    resident_reason: ResidentReason,
    keep_outside: bool,
    full_pin: bool,
    pinned: u64,
    /// Where the host copy lives.
    host_tier: HostTier,
    /// Bytes the page cache can hold for its reads when its tier reads the disk: the usable RAM the copies kept in
    /// RAM leave (each phase has it to itself, as it has the device).
    page_cache: u64,
    /// Bytes of its streamed groups whose host copy is kept in RAM where its tier reads the disk (a split, placed
    /// over RAM and the file by cost): read from the file once, then from RAM at every upload.
    ram_streamed: u64,
    /// Bytes of its streamed groups held on further devices between their uploads, with each one's copy rate
    /// (bytes per second), in the machine's order of peers: copied from there at every upload of a warm process.
    peers: Vec<(u64, f64)>,
}

impl Shape {
    fn plain(route: Route) -> Self {
        Self {
            route,
            resident_budget: 0,
            resident_reason: ResidentReason::PresetZero,
            keep_outside: true,
            full_pin: false,
            pinned: 0,
            host_tier: HostTier::Ram,
            page_cache: 0,
            ram_streamed: 0,
            peers: Vec::new(),
        }
    }
}

/// What a shape costs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct Eval {
    /// On the device, in its pages where measured.
    resident: u64,
    /// The same, in weight bytes.
    resident_weight: u64,
    window: u64,
    need: u64,
    peak: u64,
    host: u64,
    first_streamed: u64,
    steady_streamed: u64,
    first_moves: u64,
    steady_moves: u64,
    /// What the prefetch of the last call uploads for a next call that the phase does not make (it wraps into
    /// the next forward): bytes and copies, once per image.
    tail_streamed: u64,
    tail_moves: u64,
    first_seconds: f64,
    steady_seconds: f64,
    first_transfer: f64,
    steady_transfer: f64,
    compute: f64,
    kept_groups: usize,
    groups: usize,
}

impl Eval {
    fn per_image_seconds(&self, calls: u32) -> f64 {
        self.first_seconds + f64::from(calls.saturating_sub(1)) * self.steady_seconds
    }

    fn per_image_streamed(&self, calls: u32) -> u64 {
        self.first_streamed.saturating_add(u64::from(calls.saturating_sub(1)).saturating_mul(self.steady_streamed))
    }

    fn per_image_moves(&self, calls: u32) -> u64 {
        self.first_moves.saturating_add(u64::from(calls.saturating_sub(1)).saturating_mul(self.steady_moves))
    }

    /// Seconds of copies in a typical call: a later call's, or the only call's.
    fn transfer(&self, calls: u32) -> f64 {
        if calls > 1 { self.steady_transfer } else { self.first_transfer }
    }

    fn fits(&self, available: u64) -> bool {
        self.need <= available
    }
}

/// Greedy, in order: each group that still fits in the budget stays (group offload's rule: the first groups added,
/// in the order the layout lists them, that fit stay resident). Returns the bytes and the count kept.
fn kept_groups(groups: &[u64], budget: u64) -> (u64, usize) {
    let mut left = budget;
    let (mut bytes, mut count) = (0, 0);
    for &group in groups {
        if group <= left {
            left -= group;
            bytes += group;
            count += 1;
        }
    }
    (bytes, count)
}

/// Whether [`streamed_groups`] gives each group's true size (a block layout; leaves whose sizes the layout gives),
/// not an estimate (leaves counted and taken as equal): a run can then be told which sizes go where.
fn exact_sizes(spec: &ComponentSpec, shape: &Shape) -> bool {
    match (shape.route, &spec.layout) {
        (Route::BlockGroupOffload { .. }, Some(_)) => true,
        (Route::LeafGroupOffload { .. }, Some(layout)) => !layout.leaf_bytes.is_empty(),
        _ => false,
    }
}

/// The bytes of each group a component's shape streams, in the layout's order (the groups its resident budget
/// does not keep), or `None` where it streams none or has no layout. At leaf level, the layout's leaf sizes; where
/// it gives only their count, the leaves are taken as equal, and the run keeps whole leaves within a share, up to
/// it.
fn streamed_groups(spec: &ComponentSpec, shape: &Shape) -> Option<Vec<u64>> {
    let layout = spec.layout.as_ref()?;
    let groups: Vec<u64> = match shape.route {
        Route::BlockGroupOffload { blocks_per_group, .. } => {
            let groups = layout.block_bytes.chunks(blocks_per_group.max(1)).map(|g| g.iter().sum::<u64>());
            let mut budget = shape.resident_budget;
            groups
                .filter(|&group| {
                    let kept = group <= budget;
                    if kept {
                        budget -= group;
                    }
                    !kept
                })
                .collect()
        }
        Route::LeafGroupOffload { .. } if !layout.leaf_bytes.is_empty() => layout.leaf_bytes.clone(),
        Route::LeafGroupOffload { .. } if layout.leaf_count > 0 => {
            let streamed = spec.weight_bytes.saturating_sub(layout.outside_bytes);
            let count = layout.leaf_count as u64;
            (0..count).map(|leaf| streamed / count + u64::from(leaf < streamed % count)).collect()
        }
        _ => return None,
    };
    (!groups.is_empty()).then_some(groups)
}

fn evaluate(spec: &ComponentSpec, shape: &Shape, headroom: u64, time: &TimeModel) -> Eval {
    let compute = time.compute_seconds(spec.flops_per_call);
    let weight = spec.weight_bytes;
    // Pinned bytes go to the bytes streamed at every call first; the rest come from pageable memory or disk. A
    // tier on disk reads the first call's bytes from the disk (`cold`); a later call's come from the page cache
    // when it holds all of them, and from the disk again when it does not: the reads cycle through the same
    // bytes every call, and a least-recently-used cache smaller than the cycle keeps none of them by the time
    // they come round.
    let reads_disk = shape.host_tier.reads_disk();
    // A split keeps `ram_streamed` of the streamed groups in RAM: those bytes are pageable copies, and only the
    // rest reads the tier.
    let copy_from_host = |bytes: u64, transfers: u64, cold: bool| {
        let pinned = shape.pinned.min(bytes);
        let rest = bytes - pinned;
        let from_ram = if reads_disk { shape.ram_streamed.min(rest) } else { rest };
        let from_tier = rest - from_ram;
        if reads_disk && (cold || from_tier > shape.page_cache) {
            time.transfer_seconds(pinned, from_ram, from_tier, transfers)
        } else {
            time.transfer_seconds(pinned, rest, 0, transfers)
        }
    };
    // Bytes held on peers are copied from there first, each at its own link's rate; the rest from the host.
    let copy = |bytes: u64, transfers: u64, cold: bool| {
        let mut bytes = bytes;
        let mut from_peers = 0.0;
        for &(held, per_second) in &shape.peers {
            let take = held.min(bytes);
            bytes -= take;
            from_peers += take as f64 / per_second;
        }
        from_peers + copy_from_host(bytes, transfers, cold)
    };
    let in_ram = if shape.host_tier == HostTier::Ram { weight } else { shape.ram_streamed };
    let overlap = |prefetch: bool, transfer: f64| if prefetch { transfer.max(compute) } else { transfer + compute };
    let mut eval = Eval { compute, ..Eval::default() };
    match shape.route {
        Route::Resident | Route::Off => {
            eval.resident_weight = weight;
            eval.resident = spec.device_weight();
            // A resident component loaded into RAM keeps its host copy there; one the caller places is not counted.
            eval.host = if shape.route == Route::Resident { in_ram } else { 0 };
            eval.first_seconds = compute;
            eval.steady_seconds = compute;
        }
        Route::ComponentOffload => {
            eval.resident_weight = weight;
            eval.resident = spec.device_weight();
            eval.host = in_ram;
            eval.first_streamed = weight;
            eval.first_moves = 1;
            eval.first_transfer = copy(weight, 1, true);
            eval.first_seconds = eval.first_transfer + compute;
            eval.steady_seconds = compute;
        }
        Route::BlockGroupOffload { blocks_per_group, prefetch, depth } => {
            let Some(layout) = &spec.layout else { return eval };
            let groups: Vec<u64> = layout.block_bytes.chunks(blocks_per_group.max(1)).map(|g| g.iter().sum()).collect();
            let (kept, kept_count) = kept_groups(&groups, shape.resident_budget);
            let outside = layout.outside_bytes;
            let streamed_outside = if shape.keep_outside { 0 } else { outside };
            let largest = groups.iter().copied().max().unwrap_or(0).max(streamed_outside);
            eval.kept_groups = kept_count;
            eval.groups = groups.len();
            // On the device in its pages; across the link in its bytes.
            eval.resident_weight = kept + if shape.keep_outside { outside } else { 0 };
            eval.resident = spec.on_device(eval.resident_weight);
            eval.window = spec.on_device(streaming_window(largest, prefetch, depth));
            eval.host = in_ram;
            eval.first_streamed = weight;
            eval.steady_streamed = layout.blocks_total() - kept + streamed_outside;
            let steady_transfers = (groups.len() - kept_count + usize::from(!shape.keep_outside)) as u64;
            eval.first_moves = groups.len() as u64 + 1;
            eval.steady_moves = steady_transfers;
            if prefetch {
                // The last call's prefetch wraps into the next forward: the groups it streams first, in call
                // order (the outside bytes when they stream, then the groups the resident budget did not keep).
                // A component called once does it too, from the process's second image on (its first call
                // captures the order, without prefetch).
                let mut left = shape.resident_budget;
                let not_kept = groups.iter().copied().filter(|&group| {
                    let kept = group <= left;
                    if kept {
                        left -= group;
                    }
                    !kept
                });
                let next: Vec<u64> =
                    (!shape.keep_outside).then_some(outside).into_iter().chain(not_kept).take(depth).collect();
                eval.tail_streamed = next.iter().sum();
                eval.tail_moves = next.len() as u64;
            }
            eval.steady_transfer = copy(eval.steady_streamed, steady_transfers, false);
            eval.first_transfer = copy(weight, eval.first_moves, true);
            eval.first_seconds = overlap(prefetch, eval.first_transfer);
            eval.steady_seconds = overlap(prefetch, eval.steady_transfer);
        }
        Route::LeafGroupOffload { prefetch } => {
            // The layers outside the blocks stay resident, as under block offload; the blocks stream leaf by leaf.
            let (largest, leaves, outside, first) = spec.layout.as_ref().map_or((weight, 1, 0, 0), |l| {
                (l.largest_leaf_bytes, l.leaf_count as u64, l.outside_bytes, l.first_leaf_bytes)
            });
            let streamed = weight - outside.min(weight);
            eval.resident_weight = outside;
            eval.resident = spec.on_device(outside);
            eval.window = spec.on_device(streaming_window(largest, prefetch, 1));
            eval.host = in_ram;
            eval.first_streamed = weight;
            eval.steady_streamed = streamed;
            eval.first_moves = leaves + 1;
            eval.steady_moves = leaves;
            if prefetch && first > 0 {
                eval.tail_streamed = first;
                eval.tail_moves = 1;
            }
            eval.steady_transfer = copy(streamed, leaves, false);
            eval.first_transfer = copy(weight, leaves + 1, true);
            eval.first_seconds = overlap(prefetch, eval.first_transfer);
            eval.steady_seconds = overlap(prefetch, eval.steady_transfer);
        }
    }
    eval.need = eval.resident.saturating_add(eval.window).saturating_add(headroom);
    eval.peak = eval.resident.saturating_add(eval.window).saturating_add(spec.call_on_device());
    eval
}

/// Routes whose predicted times are within this factor of the fastest are a tie for `auto`.
const TIE: f64 = 1.01;

/// The share of a component's time per image that pinning must save for `auto` to pin: pinning locks RAM and
/// costs setup time, so a small gain is not worth it.
pub const PIN_GAIN: f64 = 0.05;

/// A component's route decision, with what the reasons need.
struct Choice {
    shape: Shape,
    headroom: u64,
    room: u64,
    alternatives: Vec<String>,
    /// Predicted seconds per image when the route was chosen, before pinning.
    chosen_seconds: f64,
    pin_note: Option<String>,
    /// Where its host copy lives and why, once the host tiers are placed.
    host_note: Option<String>,
    /// What it holds on the machine's peers (one share per peer), once placed.
    peer_shares: Vec<PeerShare>,
    /// The sizes of the streamed groups a split keeps in RAM, where they are known exactly.
    ram_groups: Vec<u64>,
    /// The sizes of the streamed groups it pins beside its groups on peers, where they are known exactly.
    pinned_groups: Vec<u64>,
    /// Why it holds that on the peers, or nothing.
    peer_note: Option<String>,
    warning: Option<String>,
}

/// How the host tiers were chosen.
enum HostChoice {
    /// Every copy fits in RAM.
    Fits,
    /// `low_host_memory` (or the preset's default) keeps no copy in RAM that a file or the disk store can serve.
    Spare,
    /// The copies do not fit in RAM; these left it at the least predicted cost, `seconds` per image, beside the
    /// next way to fit.
    Cheapest { seconds: f64, next: Option<String> },
    /// The `host_tier` setting chose: every copy in RAM (`ram`) or every file-backed one from its file (`file`).
    Setting(HostTierSetting),
}

/// The most components whose every subset of copies leaving RAM is priced; past it, the largest copies leave first.
const MAX_PRICED: usize = 12;

/// The ways to choose copies that leave RAM: every subset of `movable` (in index order, smallest first) when there
/// are at most [`MAX_PRICED`]; otherwise the largest-first prefixes, one per size.
fn subsets(movable: &[usize]) -> Vec<Vec<usize>> {
    if movable.len() <= MAX_PRICED {
        (0u32..1 << movable.len())
            .map(|mask| movable.iter().enumerate().filter(|(bit, _)| mask & (1 << bit) != 0).map(|(_, &i)| i).collect())
            .collect()
    } else {
        (0..=movable.len()).map(|n| movable[..n].to_vec()).collect()
    }
}

/// `a`, `a and b`, `a, b and c`.
fn join_and(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => (*one).to_string(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// What a streamed component moves per image: on its first and later steps, or in its one call.
fn streamed_per_call(eval: &Eval, calls: u32) -> String {
    if calls > 1 {
        format!(
            "; {} stream on the first step, {} on each later one",
            fs(eval.first_streamed),
            fs(eval.steady_streamed)
        )
    } else {
        format!("; {} stream in its one call", fs(eval.first_streamed))
    }
}

fn fs(bytes: u64) -> String {
    format_size(bytes)
}

/// Where the disk rate came from, in the words of the plan.
fn disk_source(source: LinkSource) -> String {
    match source {
        LinkSource::Assumed => "assumed, not measured: a run that reads from the files measures it".into(),
        LinkSource::Given => "given".into(),
        LinkSource::Measured { runs: 1, uploads } => format!("measured: one run's median, {uploads} reads"),
        LinkSource::Measured { runs, uploads } => {
            format!("measured: the median of {runs} runs' medians, {uploads} reads")
        }
    }
}

impl Planner<'_> {
    fn available(&self) -> u64 {
        self.machine.device_available
    }

    fn headroom(&self, spec: &ComponentSpec) -> u64 {
        activation_headroom(spec.call_on_device(), self.settings.reserve)
    }

    fn plan(&self, components: &[ComponentSpec]) -> Result<Plan, PlanError> {
        let mut warnings = Vec::new();
        let mut choices = Vec::with_capacity(components.len());
        let everything_fits = self.everything_fits(components);
        for spec in components {
            let choice = if self.defaults.routing == Routing::Off {
                self.fixed(spec, Route::Off)
            } else if everything_fits {
                self.fixed(spec, Route::Resident)
            } else {
                self.choose(spec)?
            };
            choices.push(choice);
        }
        self.place_host_copies(components, &mut choices, &mut warnings)?;
        self.pin(components, &mut choices);
        self.place_on_peers(components, &mut choices);

        let evals: Vec<Eval> = components
            .iter()
            .zip(&choices)
            .map(|(s, c)| evaluate(s, &c.shape, c.headroom, &self.machine.time))
            .collect();
        let resident_elsewhere = |index: usize| -> u64 {
            choices
                .iter()
                .zip(components)
                .enumerate()
                .filter(|(i, (c, _))| *i != index && matches!(c.shape.route, Route::Resident | Route::Off))
                .map(|(_, (_, s))| s.device_weight())
                .sum()
        };
        let mut plans = Vec::with_capacity(components.len());
        for (index, ((spec, choice), eval)) in components.iter().zip(&choices).zip(&evals).enumerate() {
            let calls = spec.calls_per_image;
            let peak = eval.peak.saturating_add(resident_elsewhere(index));
            let mut why = self.explain(spec, choice, eval, everything_fits, components);
            if let Some(note) = &choice.peer_note {
                why.push_str("; ");
                why.push_str(note);
            }
            warnings.extend(choice.warning.clone());
            plans.push(ComponentPlan {
                component: spec.name.clone(),
                route: choice.shape.route,
                resident_bytes: eval.resident,
                resident_weight_bytes: eval.resident_weight,
                pinned_bytes: choice.shape.pinned,
                pinned_groups: choice.pinned_groups.clone(),
                host_bytes: eval.host,
                ram_streamed_bytes: choice.shape.ram_streamed,
                ram_streamed_groups: choice.ram_groups.clone(),
                peers: choice.peer_shares.clone(),
                on_disk: choice.shape.host_tier == HostTier::DiskStore,
                host_tier: choice.shape.host_tier,
                host_copy_bytes: match (choice.shape.host_tier, choice.shape.route) {
                    (HostTier::Ram, _) => eval.host,
                    (_, Route::Resident | Route::Off) => 0,
                    _ => spec.weight_bytes,
                },
                headroom_bytes: choice.headroom,
                streamed_per_step: eval.per_image_streamed(calls) / u64::from(calls),
                streamed_per_image: eval.per_image_streamed(calls).saturating_add(eval.tail_streamed),
                moves_per_image: eval.per_image_moves(calls).saturating_add(eval.tail_moves),
                seconds_per_step: eval.per_image_seconds(calls) / f64::from(calls),
                seconds_per_image: eval.per_image_seconds(calls),
                peak_bytes: peak,
                calls_per_image: calls,
                why,
            });
        }
        let mut plan = Plan {
            preset: self.settings.preset,
            machine: self.machine.clone(),
            components: plans,
            usable_host: self.usable_host,
            warnings,
        };
        if plan.peak_bytes() > self.available() && self.defaults.routing != Routing::Off {
            plan.warnings.push(format!(
                "the predicted peak {} exceeds the {} available; lower reserve or resident_budget, or use low_ram_safe",
                fs(plan.peak_bytes()),
                fs(self.available())
            ));
        }
        for warning in &plan.warnings {
            tracing::warn!("{warning}");
        }
        Ok(plan)
    }

    /// Whether every component fits on the device at once, beside the largest headroom any of them needs.
    fn everything_fits(&self, components: &[ComponentSpec]) -> bool {
        if !self.defaults.whole_pipeline_resident {
            return false;
        }
        let weights: u64 = components.iter().map(|c| c.device_weight()).sum();
        let headroom = components.iter().map(|c| self.headroom(c)).max().unwrap_or(0);
        weights.saturating_add(headroom) <= self.available()
    }

    fn fixed(&self, spec: &ComponentSpec, route: Route) -> Choice {
        let headroom = self.headroom(spec);
        Choice {
            shape: Shape::plain(route),
            headroom,
            room: weight_room(self.available(), headroom),
            alternatives: Vec::new(),
            chosen_seconds: 0.0,
            pin_note: None,
            host_note: None,
            peer_shares: Vec::new(),
            ram_groups: Vec::new(),
            pinned_groups: Vec::new(),
            peer_note: None,
            warning: None,
        }
    }

    /// The routes the preset allows for a component, in its order of preference.
    fn candidates(&self, spec: &ComponentSpec) -> Vec<Route> {
        let s = self.settings;
        let block = Route::BlockGroupOffload {
            blocks_per_group: s.blocks_per_group,
            prefetch: s.prefetch,
            depth: s.prefetch_depth,
        };
        let leaf = Route::LeafGroupOffload { prefetch: s.prefetch };
        let mut routes = vec![Route::ComponentOffload];
        if spec.can_block_offload() {
            routes.push(block);
        }
        if spec.can_leaf_offload() {
            routes.push(leaf);
        }
        // A named profile calibrates block offload's resident budget, so a component it applies to streams by
        // blocks: the calibration run must measure the route later runs take.
        if s.profile_name.is_some()
            && spec.calls_per_image > 1
            && spec.can_block_offload()
            && s.resident_budget.is_none()
        {
            return vec![block];
        }
        match self.defaults.routing {
            Routing::Fastest | Routing::FitOrBlock | Routing::Off => routes,
            Routing::Block if spec.can_block_offload() => vec![block],
            Routing::Block | Routing::Leaf if spec.can_leaf_offload() => vec![leaf],
            Routing::Block | Routing::Leaf => vec![Route::ComponentOffload],
        }
    }

    fn shape(&self, spec: &ComponentSpec, route: Route, room: u64) -> Shape {
        let mut shape = Shape::plain(route);
        let Route::BlockGroupOffload { blocks_per_group, prefetch, depth } = route else { return shape };
        let Some(layout) = &spec.layout else { return shape };
        let s = self.settings;
        let full_pin = self.defaults.full_pin_rule
            && !s.low_host_memory
            && s.resident_budget.is_none()
            && s.pinned_budget.is_none()
            && full_pin_zero_resident(spec.weight_bytes, self.machine.device_total, self.usable_host, s.full_pin_ratio);
        let repeated = spec.calls_per_image > 1;
        let (budget, reason) = if full_pin {
            (0, ResidentReason::FullPin { ratio: s.full_pin_ratio })
        } else if let Some(budget) = s.resident_budget {
            (budget, ResidentReason::Setting)
        } else if let (Some(name), true) = (&s.profile_name, repeated) {
            match (&s.calibration, s.calibrate) {
                (Some(rec), false) => (
                    rec.resident_budget,
                    ResidentReason::Calibrated {
                        name: name.clone(),
                        budget: rec.resident_budget,
                        peak: rec.measured_peak,
                    },
                ),
                _ => (0, ResidentReason::CalibrationRun(name.clone())),
            }
        } else if self.defaults.resident == ResidentPolicy::Zero {
            (0, ResidentReason::PresetZero)
        } else if !repeated {
            (0, ResidentReason::CalledOnce)
        } else {
            let window = streaming_window(layout.largest_group(blocks_per_group), prefetch, depth);
            // The room is on the device, in its pages; the budget keeps groups by their weight bytes, as the
            // mechanism does.
            let room = spec.from_device(room);
            (resident_budget(room, layout.outside_bytes, window, layout.blocks_total()), ResidentReason::Fill)
        };
        shape.resident_budget = budget;
        shape.resident_reason = reason;
        shape.keep_outside = !full_pin;
        shape.full_pin = full_pin;
        shape
    }

    fn choose(&self, spec: &ComponentSpec) -> Result<Choice, PlanError> {
        let headroom = self.headroom(spec);
        let room = weight_room(self.available(), headroom);
        let time = &self.machine.time;
        let calls = spec.calls_per_image;
        let options: Vec<(Shape, Eval)> = self
            .candidates(spec)
            .into_iter()
            .map(|route| {
                let shape = self.shape(spec, route, room);
                let eval = evaluate(spec, &shape, headroom, time);
                (shape, eval)
            })
            .collect();
        let fitting: Vec<&(Shape, Eval)> = options.iter().filter(|(_, e)| e.fits(self.available())).collect();
        let chosen = if self.defaults.routing == Routing::Fastest {
            // Shortest predicted time. Within 1% of it the prediction cannot tell the routes apart, so the one
            // streaming the fewest bytes wins (it suffers least if the link is slower than modelled), then the
            // smallest device footprint.
            let best = fitting.iter().map(|(_, e)| e.per_image_seconds(calls)).fold(f64::INFINITY, f64::min);
            fitting
                .iter()
                .filter(|(_, e)| e.per_image_seconds(calls) <= best * TIE)
                .min_by_key(|(_, e)| (e.per_image_streamed(calls), e.need))
                .copied()
        } else {
            fitting.first().copied()
        };
        let Some((shape, chosen_eval)) = chosen else {
            let smallest = options.iter().min_by_key(|(_, e)| e.need);
            let (route, needs) = smallest.map_or(("component offload".to_string(), spec.device_weight()), |(s, e)| {
                (s.route.to_string(), e.need)
            });
            let (reason, advice) = if let Some(budget) = self.settings.resident_budget {
                (
                    format!(
                        "{} kept free for activations and resident_budget {} from {}",
                        fs(headroom),
                        fs(budget),
                        self.settings.origin("resident_budget")
                    ),
                    "lower resident_budget, or use a larger card",
                )
            } else {
                (
                    format!("{} kept free for activations", fs(headroom)),
                    "use a larger card, a smaller workload (resolution, caption length), or a smaller reserve",
                )
            };
            return Err(PlanError::DoesNotFit {
                component: spec.name.clone(),
                route,
                needs,
                available: self.available(),
                reason,
                advice,
            });
        };
        let alternatives = if self.defaults.routing == Routing::Fastest {
            options
                .iter()
                .filter(|(s, _)| s.route != shape.route)
                .map(|(s, e)| {
                    if e.fits(self.available()) {
                        format!("{} {:.2} s per image", s.route.kind(), e.per_image_seconds(calls))
                    } else {
                        format!("{} does not fit (needs {})", s.route.kind(), fs(e.need))
                    }
                })
                .collect()
        } else {
            Vec::new()
        };
        // An explicit resident budget too large for block offload is not silently dropped: say what it cost.
        let warning = match (self.settings.resident_budget, &shape.route) {
            (Some(budget), route) if !matches!(route, Route::BlockGroupOffload { .. }) => options
                .iter()
                .find(|(s, e)| matches!(s.route, Route::BlockGroupOffload { .. }) && !e.fits(self.available()))
                .map(|(_, e)| {
                    format!(
                        "{}: resident_budget {} (from {}) makes block offload need {} of the {} available, so it took \
                         {} instead; lower resident_budget",
                        spec.name,
                        fs(budget),
                        self.settings.origin("resident_budget"),
                        fs(e.need),
                        fs(self.available()),
                        shape.route
                    )
                }),
            _ => None,
        };
        let chosen_seconds = chosen_eval.per_image_seconds(calls);
        Ok(Choice {
            shape: shape.clone(),
            headroom,
            room,
            alternatives,
            chosen_seconds,
            pin_note: None,
            host_note: None,
            peer_shares: Vec::new(),
            ram_groups: Vec::new(),
            pinned_groups: Vec::new(),
            peer_note: None,
            warning,
        })
    }

    /// Places every component's host copy in a tier ([`HostTier`]) from the host budget, and says why.
    ///
    /// A resident component is loaded from its checkpoint file when it is file-backed (no host copy kept), into
    /// RAM otherwise (the copy is kept). A component that moves keeps its copy in RAM when every copy fits in the
    /// usable RAM; when they do not, the copies that can leave RAM (a file-backed one to its file, a streamed one
    /// that differs from its file to the disk store when `disk_store_dir` is set) are chosen so that they fit at
    /// the least predicted time per image, the page cache counted as the RAM the copies leave. `low_host_memory`
    /// (low_ram_safe's default) moves every copy that can leave. When what must stay in RAM does not fit, the plan
    /// is refused ([`PlanError::HostDoesNotFit`]) rather than left to swap.
    fn place_host_copies(
        &self,
        components: &[ComponentSpec],
        choices: &mut [Choice],
        warnings: &mut Vec<String>,
    ) -> Result<(), PlanError> {
        let time = self.machine.time;
        let usable = self.usable_host;
        let dir = self.settings.disk_store_dir.is_some();
        let spare = self.settings.low_host_memory;
        for (spec, choice) in components.iter().zip(choices.iter_mut()) {
            if matches!(choice.shape.route, Route::Resident | Route::Off) && spec.file_backed {
                choice.shape.host_tier = HostTier::File;
            }
        }
        // Where each copy could go instead of RAM, and what it takes in RAM.
        let targets: Vec<Option<HostTier>> = components
            .iter()
            .zip(choices.iter())
            .map(|(spec, choice)| match choice.shape.route {
                Route::Resident | Route::Off => None,
                Route::ComponentOffload => spec.file_backed.then_some(HostTier::File),
                _ if spec.file_backed => Some(HostTier::File),
                _ => dir.then_some(HostTier::DiskStore),
            })
            .collect();
        let ram: Vec<u64> =
            components.iter().zip(choices.iter()).map(|(s, c)| evaluate(s, &c.shape, c.headroom, &time).host).collect();
        let all_in_ram: u64 = ram.iter().sum();
        // Largest copy first, for the largest-first ways past `MAX_PRICED` components.
        let mut movable: Vec<usize> = (0..components.len()).filter(|&i| targets[i].is_some() && ram[i] > 0).collect();
        movable.sort_by_key(|&i| std::cmp::Reverse(ram[i]));
        // Seconds per image a component adds when its copy reads its target tier beside `page_cache` bytes of page
        // cache.
        let added = |i: usize, page_cache: u64| -> f64 {
            let (spec, choice) = (&components[i], &choices[i]);
            let moved = Shape { host_tier: targets[i].unwrap_or(HostTier::Ram), page_cache, ..choice.shape.clone() };
            let calls = spec.calls_per_image;
            evaluate(spec, &moved, choice.headroom, &time).per_image_seconds(calls)
                - evaluate(spec, &choice.shape, choice.headroom, &time).per_image_seconds(calls)
        };
        // A way to fit: the copies that leave RAM, the seconds per image they add, the bytes left in RAM.
        let way = |moved: &[usize]| -> Option<(f64, u64)> {
            let left = all_in_ram - moved.iter().map(|&i| ram[i]).sum::<u64>();
            let page_cache = usable.checked_sub(left)?;
            Some((moved.iter().map(|&i| added(i, page_cache)).sum(), left))
        };
        let names = |moved: &[usize]| -> String {
            let mut moved = moved.to_vec();
            moved.sort_unstable();
            let names: Vec<&str> = moved.iter().map(|&i| components[i].name.as_str()).collect();
            join_and(&names)
        };
        let forced = self.settings.host_tier;
        let (moved, how): (Vec<usize>, HostChoice) = if forced == HostTierSetting::Ram {
            (Vec::new(), HostChoice::Setting(forced))
        } else if forced == HostTierSetting::File {
            let files = movable.iter().copied().filter(|&i| targets[i] == Some(HostTier::File)).collect();
            (files, HostChoice::Setting(forced))
        } else if spare {
            (movable.clone(), HostChoice::Spare)
        } else if all_in_ram <= usable {
            (Vec::new(), HostChoice::Fits)
        } else {
            let mut ways: Vec<(Vec<usize>, f64, u64)> = subsets(&movable)
                .into_iter()
                .filter_map(|moved| way(&moved).map(|(seconds, left)| (moved, seconds, left)))
                .collect();
            // The fewest added seconds; at equal cost, the one keeping the most in RAM, then the fewest moves.
            ways.sort_by(|a, b| a.1.total_cmp(&b.1).then(b.2.cmp(&a.2)).then(a.0.len().cmp(&b.0.len())));
            match ways.first() {
                Some((moved, seconds, _)) => {
                    // The best way that does not merely move more than the chosen one: the alternative worth naming.
                    let next = ways
                        .iter()
                        .skip(1)
                        .find(|(other, ..)| !moved.iter().all(|i| other.contains(i)))
                        .map(|(other, s, _)| format!("{s:.2} s for {}", names(other)));
                    let how = HostChoice::Cheapest { seconds: *seconds, next };
                    (moved.clone(), how)
                }
                None => (movable.clone(), HostChoice::Cheapest { seconds: 0.0, next: None }),
            }
        };
        let in_ram = all_in_ram - moved.iter().map(|&i| ram[i]).sum::<u64>();
        if in_ram > usable {
            return Err(self.host_does_not_fit(components, choices, &targets, &ram, &moved, in_ram));
        }
        for &i in &moved {
            choices[i].shape.host_tier = targets[i].unwrap_or(HostTier::Ram);
        }
        // The RAM the copies kept whole leave is placed over the streamed groups of the copies that left it, by
        // cost, where that beats leaving it to the page cache.
        let splits = match how {
            HostChoice::Cheapest { .. } => self.split_streams(components, choices, usable - in_ram),
            _ => vec![None; components.len()],
        };
        let page_cache = usable - in_ram - choices.iter().map(|c| c.shape.ram_streamed).sum::<u64>();
        let moved_names = names(&moved);
        let stuck: Vec<usize> = (0..components.len())
            .filter(|&i| spare && choices[i].shape.route.is_group_offload() && targets[i].is_none())
            .collect();
        if !stuck.is_empty() && self.settings.is_set("low_host_memory") {
            let plural = stuck.len() > 1;
            warnings.push(format!(
                "low_host_memory is set, but {} {} in RAM: {} weights {} not file-backed and no disk_store_dir is \
                 set; set disk_store_dir",
                names(&stuck),
                if plural { "stay" } else { "stays" },
                if plural { "their" } else { "its" },
                if plural { "are" } else { "is" },
            ));
        }
        for (i, choice) in choices.iter_mut().enumerate() {
            let tier = choice.shape.host_tier;
            if tier.reads_disk() {
                choice.shape.page_cache = page_cache;
            }
            let split = splits[i].clone();
            let place = match tier {
                HostTier::File => "the checkpoint file".to_string(),
                _ => format!("in the disk store under {} (its weights are not file-backed)", self.disk_dir()),
            };
            choice.host_note = match (choice.shape.route, tier) {
                (Route::Off, _) => None,
                (Route::Resident, HostTier::Ram) => Some(format!(
                    "its weights are not file-backed, so they are loaded into RAM first and the host copy stays \
                     there ({})",
                    fs(ram[i])
                )),
                (Route::Resident, _) => {
                    Some("it is loaded from its checkpoint file straight to the device and keeps no host copy".into())
                }
                (_, HostTier::Ram) if spare => Some(format!(
                    "its host copy stays in RAM ({}): its weights are not file-backed and {}",
                    fs(ram[i]),
                    if choice.shape.route == Route::ComponentOffload {
                        "it moves whole, which the disk store does not serve"
                    } else {
                        "no disk_store_dir is set"
                    }
                )),
                (_, HostTier::Ram) => Some(match &how {
                    HostChoice::Setting(setting) => format!(
                        "its host copy stays in RAM ({}): host_tier is {} (from {})",
                        fs(ram[i]),
                        setting.name(),
                        self.settings.origin("host_tier")
                    ),
                    HostChoice::Fits => format!(
                        "its host copy stays in RAM ({}): the host copies ({}) fit in the {} of usable RAM",
                        fs(ram[i]),
                        fs(all_in_ram),
                        fs(usable)
                    ),
                    _ => format!(
                        "its host copy stays in RAM ({}): with {moved_names} read from disk, the copies kept in RAM \
                         ({}) fit in the {} of usable RAM",
                        fs(ram[i]),
                        fs(in_ram),
                        fs(usable)
                    ),
                }),
                (_, _) => Some(match &how {
                    HostChoice::Spare => format!(
                        "its host copy is {place}: {} spares host RAM, keeping no copy there that a file or the disk \
                         store can serve",
                        self.spare_source()
                    ),
                    HostChoice::Cheapest { seconds, next } => format!(
                        "its host copy is {place}: the host copies ({}) do not fit in the {} of usable RAM, and \
                         reading {moved_names} from disk is the way to fit that costs the least predicted time \
                         (+{seconds:.2} s per image{})",
                        fs(all_in_ram),
                        fs(usable),
                        next.as_ref().map(|n| format!(", against +{n}")).unwrap_or_default()
                    ),
                    HostChoice::Fits => format!("its host copy is {place}"),
                    HostChoice::Setting(setting) => format!(
                        "its host copy is {place}: host_tier is {} (from {})",
                        setting.name(),
                        self.settings.origin("host_tier")
                    ),
                }),
            };
            if let (Some(note), Some(split)) = (&mut choice.host_note, split) {
                note.push_str("; ");
                note.push_str(&split);
            }
        }
        Ok(())
    }

    /// The error for copies that must stay in RAM and do not fit, with what would.
    fn host_does_not_fit(
        &self,
        components: &[ComponentSpec],
        choices: &[Choice],
        targets: &[Option<HostTier>],
        ram: &[u64],
        moved: &[usize],
        needs: u64,
    ) -> PlanError {
        let staying: Vec<usize> = (0..components.len()).filter(|&i| ram[i] > 0 && !moved.contains(&i)).collect();
        let mut in_ram = Vec::new();
        for &i in &staying {
            let (spec, route) = (&components[i], choices[i].shape.route);
            let kind = match route {
                Route::Resident | Route::Off => "resident",
                Route::ComponentOffload => "moves whole",
                _ => "streams",
            };
            // Every copy that could leave RAM has left by now, so what stays is not file-backed, and a streamed one
            // has no disk store to go to.
            let why = if route.is_group_offload() { "not file-backed, no disk_store_dir" } else { "not file-backed" };
            in_ram.push(format!("{} {} ({kind}; {why})", spec.name, fs(ram[i])));
        }
        let mut advice = Vec::new();
        let to_store: Vec<usize> = staying
            .iter()
            .copied()
            .filter(|&i| choices[i].shape.route.is_group_offload() && targets[i].is_none())
            .collect();
        if self.settings.disk_store_dir.is_none() && !to_store.is_empty() {
            let names: Vec<&str> = to_store.iter().map(|&i| components[i].name.as_str()).collect();
            let left = needs - to_store.iter().map(|&i| ram[i]).sum::<u64>();
            advice.push(format!(
                "set disk_store_dir to keep the streamed {} of {} on disk ({} would stay in RAM)",
                if names.len() > 1 { "copies" } else { "copy" },
                join_and(&names),
                fs(left)
            ));
        }
        if staying.iter().any(|&i| !components[i].file_backed) {
            advice.push(
                "load weights as they are in their files (not quantized or LoRA-fused after loading) so the files \
                 serve them"
                    .to_string(),
            );
        }
        advice.push(format!("free {} of host RAM", fs(needs - self.usable_host)));
        let available = self.machine.host.available;
        PlanError::HostDoesNotFit {
            in_ram: in_ram.join(", "),
            needs,
            usable: self.usable_host,
            available,
            margin: available - self.usable_host,
            advice: advice.join(", or "),
        }
    }

    /// Who asked to spare host RAM: the preset's default, or the setting.
    fn spare_source(&self) -> String {
        if self.settings.is_set("low_host_memory") {
            format!("low_host_memory from {}", self.settings.origin("low_host_memory"))
        } else {
            format!("preset {}", self.settings.preset)
        }
    }

    /// Decides the pinned bytes: each component's wish by the preset's pin policy, then the pipeline's pinned
    /// budget shared out, the components that stream the most per image first.
    fn pin(&self, components: &[ComponentSpec], choices: &mut [Choice]) {
        let time = self.machine.time;
        let preset = self.settings.preset;
        let mut wishes = vec![0u64; components.len()];
        for (i, (spec, choice)) in components.iter().zip(choices.iter_mut()).enumerate() {
            let route = choice.shape.route;
            if matches!(route, Route::Resident | Route::Off) {
                continue;
            }
            let eval = evaluate(spec, &choice.shape, choice.headroom, &time);
            let repeated = spec.calls_per_image > 1 && route.is_group_offload();
            let (wish, note) = if choice.shape.host_tier == HostTier::DiskStore {
                (0, format!("nothing pinned: its host copy is on disk under {}", self.disk_dir()))
            } else if choice.shape.host_tier == HostTier::File {
                (0, "nothing pinned: its host copy is the checkpoint file, whose pages are read, not pinned".into())
            } else if self.settings.low_host_memory {
                (0, format!("nothing pinned: {} spares host RAM", self.spare_source()))
            } else if choice.shape.full_pin {
                (spec.weight_bytes, "all of it pinned (full-pin rule)".into())
            } else {
                match self.defaults.pin {
                    PinPolicy::Never => (0, format!("nothing pinned: preset {preset} pins nothing")),
                    PinPolicy::All => (eval.host, "its whole host copy pinned for the life of the process".into()),
                    PinPolicy::Repeated if repeated => (eval.steady_streamed, "its streamed groups pinned".into()),
                    PinPolicy::Repeated => (0, "nothing pinned: it crosses the link once per image".into()),
                    PinPolicy::WhenItPays if !repeated => {
                        (0, "nothing pinned: it crosses the link once per image".into())
                    }
                    PinPolicy::WhenItPays => {
                        let pinned = Shape { pinned: eval.steady_streamed, ..choice.shape.clone() };
                        let faster =
                            evaluate(spec, &pinned, choice.headroom, &time).per_image_seconds(spec.calls_per_image);
                        let slower = eval.per_image_seconds(spec.calls_per_image);
                        if faster <= slower * (1.0 - PIN_GAIN) {
                            (
                                eval.steady_streamed,
                                format!(
                                    "its streamed groups pinned: that saves {:.2} s of {:.2} s per image",
                                    slower - faster,
                                    slower
                                ),
                            )
                        } else {
                            (
                                0,
                                format!(
                                    "nothing pinned: pinning would save {:.2} s of {:.2} s per image, under {:.0}%, as pageable copies ({:.3} s a step) mostly hide under compute ({:.3} s)",
                                    slower - faster,
                                    slower,
                                    PIN_GAIN * 100.0,
                                    eval.steady_transfer,
                                    eval.compute
                                ),
                            )
                        }
                    }
                }
            };
            wishes[i] = wish;
            choice.pin_note = Some(note);
        }
        let host_copies: u64 =
            components.iter().zip(choices.iter()).map(|(s, c)| evaluate(s, &c.shape, c.headroom, &time).host).sum();
        let wanted: u64 = wishes.iter().sum();
        let mut budget = pinned_budget(self.usable_host, host_copies, wanted);
        if let Some(cap) = self.settings.pinned_budget {
            budget = budget.min(cap);
        }
        let mut order: Vec<usize> = (0..components.len()).filter(|&i| wishes[i] > 0).collect();
        let streamed = |i: usize| {
            evaluate(&components[i], &choices[i].shape, choices[i].headroom, &time)
                .per_image_streamed(components[i].calls_per_image)
        };
        order.sort_by_key(|&i| std::cmp::Reverse(streamed(i)));
        for i in order {
            let granted = wishes[i].min(budget);
            budget -= granted;
            choices[i].shape.pinned = granted;
            if granted < wishes[i] {
                let limit = match self.settings.pinned_budget {
                    Some(cap) => format!(
                        "the pinned_budget setting ({}) from {}",
                        fs(cap),
                        self.settings.origin("pinned_budget")
                    ),
                    None => format!("host RAM: {} usable for {} of host copies", fs(self.usable_host), fs(host_copies)),
                };
                choices[i].pin_note =
                    Some(format!("{} of the {} wanted pinned, limited by {limit}", fs(granted), fs(wishes[i])));
            }
        }
    }

    /// What a copy on disk reads per image, at what rate, and whether the page cache serves the later steps.
    fn disk_reads(&self, spec: &ComponentSpec, choice: &Choice, eval: &Eval) -> String {
        let tier = choice.shape.host_tier;
        if !tier.reads_disk() || matches!(choice.shape.route, Route::Resident | Route::Off) {
            return String::new();
        }
        let from = if tier == HostTier::File { "the file" } else { "the disk store" };
        let time = &self.machine.time;
        let source = match time.disk_source {
            LinkSource::Assumed => "assumed",
            LinkSource::Given => "given",
            LinkSource::Measured { .. } => "measured",
        };
        let rate = format!("{} ({source})", crate::format_rate(time.disk_bytes_per_second));
        if choice.shape.route == Route::ComponentOffload {
            return format!("; each image reads its {} from {from} at {rate}", fs(eval.first_streamed));
        }
        // Under a split the streamed groups kept in RAM are read from RAM, after the process's first read; those
        // held on peers are copied from there.
        let in_ram = choice.shape.ram_streamed;
        let peers: Vec<&str> =
            choice.peer_shares.iter().filter(|share| share.bytes > 0).map(|share| share.peer.as_str()).collect();
        let held = in_ram + choice.shape.peers.iter().map(|(bytes, _)| bytes).sum::<u64>();
        let holders = match (in_ram > 0, peers.is_empty()) {
            (true, true) => "RAM".to_string(),
            (true, false) => format!("RAM and {}", join_and(&peers)),
            (false, _) => join_and(&peers),
        };
        let first = eval.first_streamed.saturating_sub(held);
        if spec.calls_per_image <= 1 {
            return format!("; its one call reads {} from {from} at {rate}", fs(first));
        }
        let steady = eval.steady_streamed.saturating_sub(held);
        let cache = choice.shape.page_cache;
        let later = if steady == 0 {
            format!("from {holders} ({} kept there)", fs(held))
        } else if steady <= cache {
            format!("from the page cache, which keeps {} beside the copies in RAM", fs(cache))
        } else {
            format!("from {from} again: the {} left to the page cache cannot hold them", fs(cache))
        };
        let (first_note, later_bytes) = if held > 0 {
            (format!(", the rest of its {} from {holders}", fs(eval.first_streamed)), steady)
        } else {
            (String::new(), eval.steady_streamed)
        };
        if steady == 0 {
            return format!(
                "; the first step reads {} from {from} at {rate}{first_note}, each later step its {} {later}",
                fs(first),
                fs(eval.steady_streamed)
            );
        }
        format!(
            "; the first step reads {} from {from} at {rate}{first_note}, each later step {} {later}",
            fs(first),
            fs(later_bytes)
        )
    }

    fn disk_dir(&self) -> String {
        self.settings.disk_store_dir.as_ref().map(|d| d.display().to_string()).unwrap_or_default()
    }

    fn explain(
        &self,
        spec: &ComponentSpec,
        choice: &Choice,
        eval: &Eval,
        everything_fits: bool,
        all: &[ComponentSpec],
    ) -> String {
        let weight = spec.weight_bytes;
        let route = choice.shape.route;
        if route == Route::Off {
            return format!("preset off: not managed, the caller places it; predicted as resident ({})", fs(weight));
        }
        let host_note = choice.host_note.as_ref().map(|note| format!("; {note}")).unwrap_or_default();
        if everything_fits {
            let total: u64 = all.iter().map(|c| c.device_weight()).sum();
            let (largest, name) = all.iter().map(|c| (self.headroom(c), c.name.as_str())).max().unwrap_or((0, ""));
            let measured = if all.iter().any(|c| c.device_bytes.is_some()) { " (on the device, measured)" } else { "" };
            return format!(
                "everything fits at once: {} of weights{measured} plus the largest activation headroom ({} for {name}) fit in \
                 {} available, so it stays resident and nothing streams after loading{host_note}",
                fs(total),
                fs(largest),
                fs(self.available())
            );
        }
        let headroom_source = match self.settings.reserve {
            Some(_) => format!("the reserve setting from {}", self.settings.origin("reserve")),
            None => {
                let call = spec.call_on_device();
                let what = if call > spec.activation_bytes { "a call's pages, measured," } else { "estimate" };
                format!(
                    "{what} {} + margin {}, sized from the workload rather than DDO's fixed headroom tiers",
                    fs(call),
                    fs(activation_margin(call))
                )
            }
        };
        let fits = spec.device_weight() <= choice.room;
        let mut why = String::new();
        if spec.quantized {
            why.push_str(
                "its weights are quantized (sizes are their values and scales, and they stream as they are); ",
            );
        }
        let on_device = match spec.device_bytes {
            Some(device) => format!(" ({} on the device, measured)", fs(device)),
            None => String::new(),
        };
        why.push_str(&format!(
            "{} of weights{on_device} {} whole in the {} left after {} for activations ({headroom_source})",
            fs(weight),
            if fits { "fit" } else { "do not fit" },
            fs(choice.room),
            fs(choice.headroom)
        ));
        let calls = spec.calls_per_image;
        let unit = if calls > 1 { "step" } else { "call" };
        match route {
            Route::ComponentOffload => {
                why.push_str(&format!(", so it moves whole onto the device when it runs ({} per image)", fs(weight)))
            }
            Route::BlockGroupOffload { blocks_per_group, prefetch, depth } => {
                let outside = spec.layout.as_ref().map_or(0, |l| l.outside_bytes);
                let kept =
                    eval.resident.saturating_sub(spec.on_device(if choice.shape.keep_outside { outside } else { 0 }));
                let groups = format!("{} of {} groups ({})", eval.kept_groups, eval.groups, fs(kept));
                let prefetch =
                    if prefetch { format!("with prefetch depth {depth}") } else { "without prefetch".into() };
                let plural = if blocks_per_group == 1 { "" } else { "s" };
                let connector = if fits { "yet" } else { "so" };
                why.push_str(&format!(
                    ", {connector} it streams {blocks_per_group} block{plural} per group {prefetch}; "
                ));
                why.push_str(&match &choice.shape.resident_reason {
                    ResidentReason::Fill => format!("{groups} stay resident beside the {} outside the blocks", fs(outside)),
                    ResidentReason::CalledOnce => format!(
                        "it runs once per image, so a resident budget would save nothing: only the {} outside the blocks stay",
                        fs(outside)
                    ),
                    ResidentReason::PresetZero => {
                        format!("preset {} keeps only the {} outside the blocks resident", self.settings.preset, fs(outside))
                    }
                    ResidentReason::FullPin { ratio } => format!(
                        "it is {:.1}x the card, at least the full-pin ratio {ratio}, so nothing stays resident and the \
                         device's memory goes to activations",
                        weight as f64 / self.machine.device_total.max(1) as f64
                    ),
                    ResidentReason::Setting => format!(
                        "resident_budget {} from {}: {groups} stay resident",
                        fs(choice.shape.resident_budget),
                        self.settings.origin("resident_budget")
                    ),
                    ResidentReason::CalibrationRun(name) => format!(
                        "calibration run of profile {name}: only the {} outside the blocks stay resident, so the measured \
                         peak is the baseline",
                        fs(outside)
                    ),
                    ResidentReason::Calibrated { name, budget, peak } => format!(
                        "profile {name} recommends {} from a measured peak of {}: {groups} stay resident",
                        fs(*budget),
                        fs(*peak)
                    ),
                });
                why.push_str(&streamed_per_call(eval, calls));
            }
            Route::LeafGroupOffload { prefetch } => {
                why.push_str(&format!(
                    ", {} it streams its blocks leaf by leaf {}: at most {} of leaves on the device beside the {} \
                     outside the blocks, which stay resident",
                    if fits { "yet" } else { "so" },
                    if prefetch { "with prefetch" } else { "without prefetch" },
                    fs(eval.window),
                    fs(eval.resident)
                ));
                why.push_str(&streamed_per_call(eval, calls));
            }
            Route::Resident | Route::Off => why.push_str(", so it stays resident"),
        }
        why.push_str(&host_note);
        why.push_str(&self.disk_reads(spec, choice, eval));
        let seconds = eval.per_image_seconds(calls) / f64::from(calls);
        why.push_str(&format!(
            "; predicted {seconds:.3} s per {unit} (copies {:.3} s, compute {:.3} s)",
            eval.transfer(calls),
            eval.compute
        ));
        if let Some(note) = &choice.pin_note {
            why.push_str(&format!("; {note}"));
        }
        if !choice.alternatives.is_empty() {
            let before = if choice.shape.host_tier.reads_disk() { "its host tier and pinning" } else { "pinning" };
            why.push_str(&format!(
                "; chosen at {:.2} s per image before {before}, over {}",
                choice.chosen_seconds,
                choice.alternatives.join(", ")
            ));
        }
        why
    }
}
