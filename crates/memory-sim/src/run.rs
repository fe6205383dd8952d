//! Playing a pipeline on a simulated card: every use goes through the real `ComponentsManager`, so the
//! decisions, OOM retries and record are the production code's.

use std::sync::Arc;

use offload_core::{
    ComponentsManager, DeviceMemory, DeviceName, Error as CoreError, OffloadEvent, OffloadRecord, format_size,
};
use offload_strategy::OffloadStrategy;

use crate::card::{CardSpec, CardStats, SimCard};
use crate::component::ComponentProfile;
use crate::component::VirtualComponent;
use crate::error::SimError;
use crate::expect::{CardExpectation, name_of, observed};
use crate::optimum::{Moves, optimal_moves, use_budgets};
use crate::profile::PipelineProfile;

/// How to play a pipeline.
#[derive(Clone)]
pub struct RunOptions {
    /// Bytes kept free for activations.
    pub reserve: u64,
    /// Prompts run back to back.
    pub prompts: usize,
    /// Whether the manager retries after out-of-memory errors.
    pub retry_on_oom: bool,
    /// The strategy; [`offload_strategy::Auto`] when `None`.
    pub strategy: Option<Arc<dyn OffloadStrategy>>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self { reserve: 3_000_000_000, prompts: 1, retry_on_oom: true, strategy: None }
    }
}

/// What one simulated run showed.
#[derive(Debug, Clone)]
pub struct SimRun {
    /// The card it ran on.
    pub card: CardSpec,
    /// The strategy's name.
    pub strategy: String,
    /// The record as it stood before auto offload was disabled.
    pub record: OffloadRecord,
    /// The events of that record.
    pub events: Vec<OffloadEvent>,
    /// Each component's device at the end, by id, before disabling.
    pub placement: Vec<(String, DeviceName)>,
    /// Link and compute totals.
    pub stats: CardStats,
    /// The card's peak allocation.
    pub peak: u64,
    /// The sequence of uses, by component name.
    pub uses: Vec<String>,
    /// Uses that completed.
    pub completed: usize,
    /// The error that stopped the run, if one did.
    pub error: Option<String>,
    /// The offline optimum for the uses that completed, under the card's rules (see [`crate::optimum`]): a
    /// lower bound for what this run moved. `None` when it could not be searched.
    pub optimum: Option<Moves>,
    /// The memory the optimum's budgets start from: the card's usable bytes, or in soft mode the run's peak
    /// where that is more.
    pub optimum_memory: u64,
}

impl SimRun {
    /// OOM retries made (one per `oom_retry` row).
    pub fn oom_retries(&self) -> usize {
        observed(&self.events, &[]).oom.values().sum()
    }

    /// Bytes moved both ways.
    pub fn moved(&self) -> u64 {
        self.stats.bytes_to_device + self.stats.bytes_to_host
    }

    /// The run in the shape of a card declaration.
    pub fn observed(&self) -> CardExpectation {
        observed(&self.events, &self.placement)
    }

    /// A few lines for people: time, bytes moved, the optimum, peak, retries, final devices.
    pub fn summary(&self) -> String {
        let optimum = self.optimum.map_or_else(
            || "not searched".to_string(),
            |m| {
                format!(
                    "{} (a bound: weights beside each call's needs within {})",
                    format_size(m.total()),
                    format_size(self.optimum_memory)
                )
            },
        );
        let placement: Vec<String> =
            self.placement.iter().map(|(id, device)| format!("{}={}", name_of(id), device.kind())).collect();
        let mut text = format!(
            "card {} ({} in {} mode, strategy {}): {} of {} uses ran\n  simulated time {:.2} s (link {:.2} s, compute {:.2} s)\n  moved {} (to device {}, to host {}), optimum {}\n  peak {}, OOM retries {}\n  final devices: {}",
            self.card.label,
            format_size(self.card.capacity),
            match self.card.mode {
                crate::card::Mode::Soft => "soft",
                crate::card::Mode::Hard => "hard",
            },
            self.strategy,
            self.completed,
            self.uses.len(),
            self.stats.serial_seconds(),
            self.stats.transfer_seconds,
            self.stats.compute_seconds,
            format_size(self.moved()),
            format_size(self.stats.bytes_to_device),
            format_size(self.stats.bytes_to_host),
            optimum,
            format_size(self.peak),
            self.oom_retries(),
            placement.join(" "),
        );
        if let Some(error) = &self.error {
            text.push_str(&format!("\n  stopped: {error}"));
        }
        text
    }
}

/// Plays `prompts` prompts of a pipeline on a card through a fresh `ComponentsManager` with auto offload.
///
/// A run that fails (a component that does not fit alone in hard mode) is returned with `error` set and the
/// state it reached: that is an outcome to report, not a failure of the simulation. Impossible configurations
/// (a reserve larger than the card) are errors.
pub fn simulate(profile: &PipelineProfile, card: CardSpec, options: &RunOptions) -> Result<SimRun, SimError> {
    replay(&profile.components, &profile.uses(options.prompts), card, options)
}

/// Plays a schedule of uses (component names, in order: one captured from a real run with
/// [`ComponentsManager::uses`], say) over virtual components through a fresh `ComponentsManager` with auto
/// offload, as [`simulate`] does for a profile's flow; `options.prompts` is not used.
///
/// It is how a run on one strategy is set beside another on the same schedule: replayed on a card that charges
/// what the real run was charged, the manager decides exactly as it did.
pub fn replay(
    components: &[ComponentProfile],
    uses: &[String],
    card: CardSpec,
    options: &RunOptions,
) -> Result<SimRun, SimError> {
    card.check_reserve(options.reserve)?;
    let sim = SimCard::new(card.clone());
    let manager = ComponentsManager::new();
    let mut ids = Vec::new();
    for component in components {
        let id = manager.add(&component.name, VirtualComponent::new(component.clone(), sim.clone()), None)?;
        ids.push(id);
    }
    manager.enable_auto_offload(sim.clone(), options.reserve, options.retry_on_oom)?;
    let strategy_name = match &options.strategy {
        Some(strategy) => {
            manager.set_offload_strategy(strategy.clone())?;
            strategy.name().to_string()
        }
        None => "auto".to_string(),
    };
    let uses = uses.to_vec();
    let mut completed = 0;
    let mut error = None;
    for name in &uses {
        let index = components.iter().position(|c| &c.name == name).ok_or_else(|| SimError::ImpossibleCard {
            label: card.label.clone(),
            problem: format!("the flow uses {name}, which the profile lacks"),
        })?;
        match manager.run(&ids[index], |component: &mut VirtualComponent| component.call()) {
            Ok(_) => completed += 1,
            Err(e @ (CoreError::DoesNotFit { .. } | CoreError::Component { .. })) => {
                error = Some(e.to_string());
                break;
            }
            Err(other) => return Err(other.into()),
        }
    }
    let record = manager.offload_record();
    let events = record.events();
    let placement = manager.placement();
    let snapshot = OffloadRecord::new();
    for event in &events {
        snapshot.add(event.clone());
    }
    // Figures of the run itself: the moves that disabling makes afterwards are not the pipeline's.
    let (stats, peak) = (sim.stats(), sim.peak());
    manager.disable_auto_offload()?;
    // The optimum of the uses that completed, under the card's rules: its usable memory, or in soft mode what
    // the run itself allocated where that is more; never the strategy's reserve.
    let sizes: Vec<u64> = components.iter().map(|c| c.bytes).collect();
    let use_indices: Vec<usize> =
        uses[..completed].iter().filter_map(|name| components.iter().position(|c| &c.name == name)).collect();
    let usable = card.usable();
    let optimum_memory = match card.mode {
        crate::card::Mode::Hard => usable,
        crate::card::Mode::Soft => usable.max(peak),
    };
    let working: Vec<u64> = components.iter().map(|c| c.activations.working).collect();
    let left_behind: Vec<u64> = components.iter().map(|c| c.activations.left_behind).collect();
    let budgets = use_budgets(&use_indices, &working, &left_behind, optimum_memory);
    Ok(SimRun {
        strategy: strategy_name,
        record: snapshot,
        events,
        placement,
        stats,
        peak,
        uses,
        completed,
        error,
        optimum: optimal_moves(&sizes, &use_indices, |at| budgets[at]),
        optimum_memory,
        card,
    })
}
