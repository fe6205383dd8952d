//! The schedule of a run: the uses the manager captured while the pipeline ran, a [`Lookahead`] built from
//! the first image's for the images after it, and a run's bytes moved set beside `auto`'s on the same schedule
//! and beside the optimum.
//!
//! A lookahead strategy needs the future: which component runs when. A diffusion pipeline's flow repeats image
//! after image (encode, the denoising steps, decode), so the uses of the first image of a process, captured by
//! the manager ([`ComponentsManager::uses`](offload_core::ComponentsManager::uses)), are the schedule of each
//! image after it. The first image runs under [`Auto`]; the later ones under a [`Lookahead`] over that schedule
//! repeated ([`lookahead_after_first_image`]).
//!
//! To set a strategy's bytes beside another's, the whole schedule is replayed by `memory-sim`
//! ([`memory_sim::replay`]) through the same `ComponentsManager` and strategies, over virtual components of the
//! pipeline's sizes that are charged its activation estimates per call. On a simulated card this is exactly what
//! the card charged the run, so the replay decides as the run did (the report says whether it reproduced the
//! run's bytes); on a real device it is a prediction. The optimum is the replay's: the bound of
//! [`memory_sim::optimum`] for the schedule, under the card's rules.

use std::fmt;
use std::sync::Arc;

use memory_sim::{ActivationProfile, CardSpec, ComponentProfile, RunOptions, replay};
use offload_core::{Action, ComponentsManager, format_size};
use offload_strategy::{Auto, Lookahead, OffloadStrategy, OffloadView, Sequential};

use crate::error::{Error, Result};
use crate::pipeline::{GenerateOptions, ZImagePipeline};

/// The manager strategy a command-line run asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StrategyChoice {
    /// The anchor's rule: offload the smallest components that free enough (`Auto`).
    Auto,
    /// Offload everything else before each onload (`Sequential`).
    Sequential,
    /// `Auto` for the first image; then Belady's rule over the schedule the first image showed.
    Lookahead,
}

impl StrategyChoice {
    /// Parses `auto`, `sequential` or `lookahead`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "auto" => Ok(Self::Auto),
            "sequential" => Ok(Self::Sequential),
            "lookahead" => Ok(Self::Lookahead),
            other => Err(Error::InvalidArgument {
                name: "strategy",
                reason: format!("unknown strategy {other:?}: choose auto, sequential or lookahead"),
            }),
        }
    }

    /// The strategy's name, as its [`OffloadStrategy::name`].
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Sequential => "sequential",
            Self::Lookahead => "lookahead",
        }
    }

    /// The strategy the first image runs under: the lookahead has no schedule yet, so it starts as `auto`.
    pub fn first_image(self) -> Arc<dyn OffloadStrategy> {
        match self {
            Self::Sequential => Arc::new(Sequential),
            Self::Auto | Self::Lookahead => Arc::new(Auto),
        }
    }
}

/// A lookahead over the first image's uses repeated for `images` images in all, positioned as the manager counts
/// uses (use 1 is the first image's first run), so it is in place for the second image's first use.
pub fn lookahead_after_first_image(first_image: &[String], images: usize) -> Lookahead {
    Lookahead::new((0..images).flat_map(|_| first_image.iter().cloned()))
}

/// `Auto` for the first `first` uses, then a [`Lookahead`]: what a `lookahead` run does, as one strategy for a
/// replay.
#[derive(Debug, Clone)]
pub struct LookaheadAfter {
    /// Uses decided by `Auto`, before the schedule is known.
    pub first: u64,
    /// The lookahead for the uses after them.
    pub lookahead: Lookahead,
}

impl OffloadStrategy for LookaheadAfter {
    fn decide(&self, view: &OffloadView<'_>) -> Vec<String> {
        if view.use_index <= self.first { Auto.decide(view) } else { self.lookahead.decide(view) }
    }

    fn name(&self) -> &str {
        "lookahead"
    }
}

/// The virtual components a replay plays for `pipeline` generating with `opts`: each component's resident
/// bytes, charged its activation estimate on each call in one allocation, with nothing left behind (what a
/// simulated card charges the pipeline); the components on the execution device only.
pub fn replay_components(pipeline: &ZImagePipeline, opts: &GenerateOptions) -> Result<Vec<ComponentProfile>> {
    let estimates = pipeline.activation_estimates(opts);
    pipeline
        .components()
        .into_iter()
        .zip(estimates)
        // The card charges only what runs on it: a component the device map puts elsewhere is not replayed.
        .filter(|(component, _)| pipeline.device_map().on_default(component.name()))
        .map(|(component, working)| (component.id(), working))
        .map(|(id, working)| {
            let info = pipeline.manager().component_info(id)?;
            Ok(ComponentProfile {
                name: info.name,
                bytes: info.resident_bytes,
                activations: ActivationProfile::new(working, 0),
                flops: 0.0,
            })
        })
        .collect()
}

/// Whole-component moves in the manager's record: their count and bytes (group uploads are not counted).
pub fn recorded_moves(manager: &ComponentsManager) -> (usize, u64) {
    let ids = manager.ids();
    manager
        .offload_record()
        .events()
        .iter()
        .filter(|e| ids.contains(&e.id) && matches!(e.action, Action::Onload | Action::Offload))
        .fold((0, 0), |(count, bytes), e| (count + 1, bytes + e.bytes))
}

/// Group offload's moves in the manager's record (a group's id is `component/group`): their count and bytes.
pub fn recorded_group_moves(manager: &ComponentsManager) -> (usize, u64) {
    manager
        .offload_record()
        .events()
        .iter()
        .filter(|e| e.id.contains('/') && matches!(e.action, Action::Onload | Action::Offload))
        .fold((0, 0), |(count, bytes), e| (count + 1, bytes + e.bytes))
}

/// A run's moves beside `auto`'s on the same schedule and the optimum's.
#[derive(Debug, Clone)]
pub struct MovesComparison {
    /// The run's strategy.
    pub strategy: String,
    /// Uses in the schedule.
    pub uses: usize,
    /// Moves and bytes the run made, from its record.
    pub measured: (usize, u64),
    /// Moves and bytes of the same strategy replayed on the schedule.
    pub replayed: (usize, u64),
    /// Moves and bytes of `auto` replayed on the schedule.
    pub auto: (usize, u64),
    /// The optimum's bytes for the schedule (a lower bound), when searched.
    pub optimum: Option<u64>,
    /// The memory the optimum's budgets start from.
    pub optimum_memory: u64,
    /// Group offload's uploads and releases in the run (not the strategy's decisions, and not replayed).
    pub group_moves: (usize, u64),
    /// Whether the card charged the run exactly what the replay charges (a simulated card), so the replayed
    /// figures are what the strategies move on it rather than a prediction.
    pub exact: bool,
}

impl fmt::Display for MovesComparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.exact { "replayed on the same simulated card" } else { "predicted by a replay" };
        writeln!(f, "moves over {} uses:", self.uses)?;
        writeln!(
            f,
            "  {:<10} {:>3} moves, {:>10} (this run, from its record)",
            self.strategy,
            self.measured.0,
            format_size(self.measured.1)
        )?;
        if self.group_moves.0 > 0 {
            writeln!(
                f,
                "  {:<10} {:>3} moves, {:>10} (group uploads and releases: group offload's, not the strategy's)",
                "groups",
                self.group_moves.0,
                format_size(self.group_moves.1)
            )?;
        }
        if self.strategy != "auto" {
            writeln!(f, "  {:<10} {:>3} moves, {:>10} ({kind})", "auto", self.auto.0, format_size(self.auto.1))?;
        }
        match self.optimum {
            Some(bytes) => writeln!(
                f,
                "  {:<10}            {:>10} (a lower bound: the resident weights beside each call's estimate within {})",
                "optimum",
                format_size(bytes),
                format_size(self.optimum_memory)
            )?,
            None => writeln!(f, "  optimum not searched")?,
        }
        if self.replayed != self.measured {
            write!(
                f,
                "  the replay of {} moved {} in {} moves, not the run's: the run moved parts the replay cannot see \
                 (group offload) or was charged other than its estimates",
                self.strategy,
                format_size(self.replayed.1),
                self.replayed.0
            )?;
        } else {
            write!(f, "  the replay of {} reproduces the run's whole-component moves", self.strategy)?;
        }
        Ok(())
    }
}

/// Sets the run of `pipeline` (generating with `opts`, under `strategy`, whose first `first_image_uses` uses
/// ran under `auto` when it is a lookahead) beside `auto` and the optimum on the schedule the manager captured,
/// replayed on `card` with `reserve`. `exact` says whether `card` is the simulated card the run was charged on.
pub fn compare_moves(
    pipeline: &ZImagePipeline,
    opts: &GenerateOptions,
    strategy: StrategyChoice,
    first_image_uses: usize,
    card: CardSpec,
    reserve: u64,
    exact: bool,
) -> Result<MovesComparison> {
    let manager = pipeline.manager();
    let uses = manager.uses();
    let components = replay_components(pipeline, opts)?;
    let play = |strategy: Arc<dyn OffloadStrategy>| {
        let options = RunOptions { reserve, prompts: 1, retry_on_oom: true, strategy: Some(strategy) };
        Ok::<_, Error>(replay(&components, &uses, card.clone(), &options)?)
    };
    let same: Arc<dyn OffloadStrategy> = match strategy {
        StrategyChoice::Lookahead => {
            Arc::new(LookaheadAfter { first: first_image_uses as u64, lookahead: Lookahead::new(uses.iter().cloned()) })
        }
        other => other.first_image(),
    };
    let replayed = play(same)?;
    let auto = play(Arc::new(Auto))?;
    let count = |run: &memory_sim::SimRun| {
        run.events.iter().filter(|e| matches!(e.action, Action::Onload | Action::Offload)).count()
    };
    Ok(MovesComparison {
        strategy: strategy.name().to_string(),
        uses: uses.len(),
        measured: recorded_moves(manager),
        group_moves: recorded_group_moves(manager),
        replayed: (count(&replayed), replayed.moved()),
        auto: (count(&auto), auto.moved()),
        optimum: replayed.optimum.map(|m| m.total()),
        optimum_memory: replayed.optimum_memory,
        exact,
    })
}
